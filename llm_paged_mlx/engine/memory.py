"""How much memory the K/V pool may take: the device's memory, less what is in use and a step's activations.

``kv_budget_bytes="auto"`` sizes the pool the way vLLM's ``gpu_memory_utilization``
does: a fraction of the memory the device can give (Metal: its recommended
working set; CUDA: its memory; the CPU: the RAM still available), never more
than MLX's memory limit (``mx.set_memory_limit``), less the memory already in
use (the weights) and a reserve for the largest step's activations. The total
is a cap on peak memory: MLX allocates a step's arrays as it queues their work,
ahead of the device, and waits only at its memory limit, so the engine lowers
that limit to the total (less what an allocation may overshoot it by). Each
engine sizes its budget as if it were alone in the process.
"""

import contextlib
import os
from typing import Optional

import mlx.core as mx
import mlx.nn as nn

from ..kernels.portable import PREFILL_ATTENTION_BYTES
from ..models.merged_projections import MergedPart
from ..models.adapt import model_config
from ..models.quantized_rows import dequantized_bytes, dequantized_rows

OVERSHOOT = 1 / 40  # of the total: MLX's allocations pass its limit by up to one array (measured: 1.5%)

_lowered: dict = {}  # the memory limit this module set -> the one it replaced


def device_memory() -> int:
    """The bytes MLX's default device can give this process, within MLX's memory limit."""
    info = mx.device_info()
    if mx.default_device() == mx.gpu:
        total = info.get("max_recommended_working_set_size") or info.get("total_memory") or info["memory_size"]
    else:
        total = mx.get_active_memory() + (available_ram() or 0)
    return min(int(total), memory_limit())


def memory_limit() -> int:
    """MLX's memory limit, as it was before an auto budget lowered it."""
    limit = mx.get_memory_limit()
    return _lowered.get(limit, limit)


def available_ram() -> Optional[int]:
    """Bytes of host memory available without swapping (Linux: MemAvailable; else free pages), or None."""
    with contextlib.suppress(OSError, ValueError, IndexError), open("/proc/meminfo") as meminfo:
        for line in meminfo:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def step_reserve(model, max_tokens: int, logit_rows: int) -> int:
    """An upper estimate of a step's activation memory: ``max_tokens`` tokens, ``logit_rows`` rows of logits.

    Per token: the residual stream, norms and projections, and the MLP's hidden
    layer (and with MLA, the absorbed queries: a latent row per head), all
    counted as float32 with room for a few live copies; the logits with the
    sampler's float32 copies; a prefill chunk's attention, which the
    kernels keep within ``PREFILL_ATTENTION_BYTES``; and two of the largest
    weights a step dequantizes (``quantized_rows``), of merged projections too.
    """
    config = model_config(model)
    hidden = _field(config, "hidden_size", 4096)
    intermediate = _field(config, "intermediate_size", 4 * hidden)
    vocab = _field(config, "vocab_size", 32000)
    latent_queries = _field(config, "num_attention_heads", 0) * (
        _field(config, "kv_lora_rank", 0) + _field(config, "qk_rope_head_dim", 0)
    )
    per_token = 4 * (8 * hidden + 3 * intermediate + 3 * latent_queries)
    dequantized = 2 * _largest_dequantized(model, max_tokens, logit_rows)
    return max_tokens * per_token + 3 * 4 * logit_rows * vocab + PREFILL_ATTENTION_BYTES + dequantized


def _largest_dequantized(model, max_tokens: int, logit_rows: int) -> int:
    """The bytes of the largest weight a step dequantizes: a layer's once it multiplies ``dequantized_rows()``
    rows (the output head's rows are the logits'), merged projections as one."""
    largest, rows = 0, dequantized_rows()
    if rows is None:
        return 0
    for name, module in model.named_modules():
        layer = module.product.merged if isinstance(module, MergedPart) else module
        head = name.split(".")[-1] == "lm_head" or isinstance(layer, nn.QuantizedEmbedding)
        if (logit_rows if head else max_tokens) >= rows:
            largest = max(largest, dequantized_bytes(layer))
    return largest


def auto_kv_budget(reserve: int, fraction: float) -> int:
    """The pool's bytes: ``fraction`` of ``device_memory()``, less the memory in use and ``reserve``.

    Lowers MLX's memory limit to that total, less ``OVERSHOOT``, if it is higher.
    """
    if not 0 < fraction <= 1:
        raise ValueError(f"memory_fraction must be in (0, 1], not {fraction}")
    total = int(fraction * device_memory())
    budget = total - mx.get_active_memory() - reserve
    if budget <= 0:
        raise ValueError(
            f"no memory is left for the KV cache: {fraction:.0%} of the device's {format_size(device_memory())} "
            f"less the {format_size(mx.get_active_memory())} in use leaves less than a step needs "
            f"({format_size(reserve)}); raise memory_fraction or give kv_budget_bytes"
        )
    limit = int(total * (1 - OVERSHOOT))
    if limit < mx.get_memory_limit():
        _lowered[limit] = memory_limit()
        mx.set_memory_limit(limit)
    return budget


def format_size(num_bytes: int) -> str:
    """Bytes in GiB or MiB, for messages."""
    return f"{num_bytes / 2**30:.2f} GiB" if num_bytes >= 2**30 else f"{num_bytes / 2**20:.1f} MiB"


def _field(config, name: str, default: int) -> int:
    value = getattr(config, name, None)
    if not isinstance(value, int):
        text_config = getattr(config, "text_config", None) or {}
        value = text_config.get(name) if isinstance(text_config, dict) else getattr(text_config, name, None)
    return value if isinstance(value, int) else default
