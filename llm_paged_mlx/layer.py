"""A self-contained attention layer over paged KV, for building on the block manager directly."""

import math

import mlx.core as mx
import mlx.nn as nn

from .engine.block_manager import BlockManager
from .kernels import AttentionPlan, PrefillChunk, select_kernel
from .models.paged_cache import PagedLayerCache


class PagedAttentionLayer(nn.Module):
    """Causal multi-head attention whose K/V live in the manager's blocks.

    ``layer(x, seq_id=s)`` takes ``x`` of shape ``(tokens, num_heads * head_dim)``,
    appends those tokens' K/V to sequence ``s`` and attends causally over all
    the sequence holds. Layers sharing a manager share its block tables, each
    with its own pool. (No positional encoding: that is the model's business.)
    """

    def __init__(
        self,
        num_heads: int,
        head_dim: int,
        manager: BlockManager,
        *,
        num_kv_heads: int | None = None,
        dtype: mx.Dtype = mx.float32,
        attention_kernel: str = "auto",
    ):
        super().__init__()
        kv_heads = num_kv_heads or num_heads
        if num_heads % kv_heads:
            raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({kv_heads})")
        if manager.num_heads not in (None, num_heads) or manager.head_dim not in (None, head_dim):
            raise ValueError(f"the manager was made for {manager.num_heads} heads of {manager.head_dim}, not "
                             f"{num_heads} of {head_dim}")  # fmt: skip
        dims = num_heads * head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, kv_heads, head_dim
        self.scale = 1 / math.sqrt(head_dim)
        self.q_proj = nn.Linear(dims, num_heads * head_dim, bias=False)
        self.k_proj = nn.Linear(dims, kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(dims, kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(num_heads * head_dim, dims, bias=False)
        self.manager = manager
        kernel = select_kernel(attention_kernel)
        self.pool = PagedLayerCache(manager.num_blocks, manager.block_size, kv_heads, head_dim, head_dim, dtype, kernel)
        self.written: dict = {}  # tokens of each sequence this layer has written

    def __call__(self, x: mx.array, seq_id=0) -> mx.array:
        if x.ndim != 2 or x.shape[1] != self.num_heads * self.head_dim:
            raise ValueError(f"x must be (tokens, {self.num_heads * self.head_dim}), got {tuple(x.shape)}")
        n = x.shape[0]
        start = self.written.get(seq_id, 0) if seq_id in self.manager.named else 0
        slots = self.manager.ensure_slots(seq_id, start + n)[start:]
        table = self.manager.sequence(seq_id).table
        used = mx.array(table[: -(-(start + n) // self.manager.block_size)], dtype=mx.int32)
        plan = AttentionPlan(
            block_size=self.manager.block_size,
            positions=mx.arange(start, start + n, dtype=mx.int32),
            slots=mx.array(slots, dtype=mx.int32),
            num_decode=1 if n == 1 else 0,
            decode_block_tables=used[None] if n == 1 else mx.zeros((0, 0), dtype=mx.int32),
            decode_context_lens=mx.array([start + 1] if n == 1 else [], dtype=mx.int32),
            prefills=[] if n == 1 else [PrefillChunk(0, n, start + n, used)],
        )
        q = self.q_proj(x).reshape(n, self.num_heads, 1, self.head_dim)
        k = self.k_proj(x).reshape(n, self.num_kv_heads, 1, self.head_dim)
        v = self.v_proj(x).reshape(n, self.num_kv_heads, 1, self.head_dim)
        self.pool.plan = plan
        self.pool.update_and_fetch(k, v)
        out = self.pool.attend(q, self.scale)
        self.pool.plan = None
        self.written[seq_id] = start + n
        return self.o_proj(out.reshape(n, -1))
