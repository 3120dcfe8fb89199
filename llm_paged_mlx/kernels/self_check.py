"""The verdict of a fused kernel's first-use self-check: use it, or warn once and use the portable kernel."""

import warnings
from collections.abc import Callable


def passes(kernel: str, config: str, error: Callable[[], float], tolerance: float) -> bool:
    """Whether ``kernel`` (its name, e.g. "cuda paged attention") may serve ``config``: ``error()``
    measures its relative error against the portable kernel. A compile or launch error, or an error
    above ``tolerance`` (NaN included), warns and returns False."""
    try:
        measured = error()
    except Exception as exc:  # a compile or launch error: any failure means "don't use it"
        warnings.warn(f"{kernel} kernel failed for {config} ({exc}); using the portable kernel", RuntimeWarning,
                      stacklevel=4)  # fmt: skip
        return False
    if not measured <= tolerance:
        warnings.warn(
            f"{kernel} kernel disagrees with the portable kernel for {config} (relative error {measured:.2e}); "
            "using the portable kernel",
            RuntimeWarning,
            stacklevel=4,
        )
        return False
    return True
