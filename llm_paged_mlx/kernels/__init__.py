"""Paged attention kernels, chosen by name from the plugin registry.

A kernel is an ``AttentionKernel``: it has

- ``name``: the name it is registered under;
- ``auto_priority``: an int; ``"auto"`` picks the available kernel with the highest;
- ``is_available()``: whether it can run on the current default device;
- ``__call__(queries, k_pool, v_pool, plan, scale)``: ``queries`` is
  ``(T, Hq, 1, D)``, one row per scheduled token (see ``plan.AttentionPlan``);
  the pools are ``(num_blocks, Hkv, block_size, D)``; returns ``(T, Hq, 1, Dv)``.

and declares what else it does by overriding the base class's defaults, which
say it does none of this:

- ``compilable = True``: ``__call__`` builds its result from MLX operations on
  its inputs alone (no evaluation, no Python branch on array values), so the
  engine may trace it with ``mx.compile`` into a step that is replayed for
  later steps of the same shape. Kernels without it run eagerly.
- ``prefill_as_rows(num_tokens, context_len) -> bool``: whether a prefill chunk
  is best served as ``num_tokens`` single-query rows; a step whose chunks all
  are then reaches the kernel as decode rows only.
- ``quantized = True``: the kernel also reads quantized pools: with ``kv_bits``
  the pools it gets are ``quantized.QuantizedPool`` objects (packed values,
  scales and biases; ``.shape`` and ``.dtype`` are those of the values). The
  engine refuses ``kv_bits`` with kernels without it.
- ``windowed = True``: ``__call__`` also takes ``window`` (each query attends
  to its last ``window`` tokens only) and ``sinks`` (``(Hq,)`` logits, one
  per query head, that join the softmax with no value) as keyword arguments,
  both passed when either is set. The engine refuses sliding-window models with kernels
  without it.
- ``softcapped = True``: ``__call__`` also takes ``softcap`` as a keyword
  argument (passed when set): scores are taken as ``softcap * tanh(scores /
  softcap)`` before the mask and softmax (Gemma 2). The engine refuses such
  models with kernels without it.
- ``in_place_writes = True``: its ``write_and_attend`` writes a step's K/V
  into the pools in place (``kernels.in_place``).
- ``applies_rope = True``: its ``write_and_attend`` also takes ``rope`` (a
  ``rope.RopeSpec``) as a keyword argument: a decode step's queries and keys
  come unrotated, to be rotated at the plan's positions (``plan.rope_table``),
  or None returned, and the engine rotates them with the model's own RoPE.
- ``verdict_file``: set by the engine to the file where its verdicts are kept
  (or None): a kernel that checks itself at first use may keep its verdicts
  there for later processes (``verdicts``; the fused kernels do, through
  ``self_check.passes``).
- ``latent_attention(queries, pool, value_dim, plan, scale)``: multi-head
  latent attention (MLA) over one pool ``(num_blocks, 1, block_size, D)``
  whose rows are the keys and whose first ``value_dim`` values are the values;
  ``queries`` are ``(T, Hq, 1, D)``, the result ``(T, Hq, 1, value_dim)``. The
  engine refuses MLA models with kernels without it.

Only steps of single-query rows are traced: a kernel may evaluate arrays while
it serves prefill chunks (the portable kernel does, to bound their memory).
"""

import warnings

import mlx.core as mx

from .. import plugins
from ..errors import one_line
from .base import AttentionKernel
from .plan import AttentionPlan, PrefillChunk


def select_kernel(name: str = "auto") -> AttentionKernel:
    """The kernel registered as ``name``, or for ``"auto"`` the best available one."""
    registry = plugins.attention_kernels()
    if name != "auto":
        kernel = _made(name, plugins.lookup("attention kernel", registry, name))
        if not kernel.is_available():
            raise ValueError(f"attention kernel {name!r} cannot run on {mx.default_device()}")
        return kernel
    available = []
    for name, factory in registry.items():
        try:
            kernel = _made(name, factory)
            if kernel.is_available():
                available.append(kernel)
        except Exception as e:  # a broken plugin costs its own kernel, not the choice among the others
            warnings.warn(f"attention kernel {name!r} left out of 'auto': {one_line(e)}", RuntimeWarning)
    return max(available, key=lambda k: k.auto_priority)


def _made(name: str, factory) -> AttentionKernel:
    kernel = factory()
    if not isinstance(kernel, AttentionKernel):
        raise ValueError(f"attention kernel {name!r} is a {type(kernel).__name__}, not an "
                         "llm_paged_mlx.kernels.AttentionKernel: a kernel subclasses it")  # fmt: skip
    return kernel


__all__ = ["AttentionKernel", "AttentionPlan", "PrefillChunk", "select_kernel"]
