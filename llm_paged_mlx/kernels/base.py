"""The base class of paged attention kernels (the interface is described in ``kernels``)."""

from typing import Callable, Optional

import mlx.core as mx

from .plan import AttentionPlan


class AttentionKernel:
    """The base of every paged attention kernel: what a kernel must have, and the defaults of what it may
    declare (see ``kernels``)."""

    name: str
    auto_priority: int = 0
    compilable = False
    quantized = False
    windowed = False
    softcapped = False
    in_place_writes = False
    applies_rope = False
    prefill_as_rows: Optional[Callable[[int, int], bool]] = None
    latent_attention: Optional[Callable] = None
    write_and_attend: Optional[Callable] = None
    verdict_file = None  # set by the engine: where first-use self-checks keep their verdicts (None: nowhere)

    def is_available(self) -> bool:
        raise NotImplementedError

    def __call__(self, queries, k_pool, v_pool, plan: AttentionPlan, scale: float, **masking) -> mx.array:
        raise NotImplementedError
