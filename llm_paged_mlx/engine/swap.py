"""Swap policies: what happens to a preempted request's K/V.

``swap_out(blocks, runner)`` runs when a request is preempted, before its
blocks are reused, and returns a handle (or None to recompute the tokens
later). ``swap_in(handle, blocks, runner)`` writes the kept K/V into the
request's new blocks when it is resumed. A policy that keeps its copies
somewhere that needs releasing (a file, say) also has ``discard(handle)``:
the engine calls it once a handle is no longer needed (swapped in, its
request finished, or its preemption undone with a failed step).
"""

import mlx.core as mx

from ..hookspecs import hookimpl
from .disk.format import device, host


class RecomputePolicy:
    """Drop the K/V; the request is prefilled again (cached prefix blocks make that cheap)."""

    name = "recompute"

    def swap_out(self, blocks, runner):
        return None

    def swap_in(self, handle, blocks, runner):
        raise RuntimeError("recompute keeps nothing to swap in")


class CPUSwapPolicy:
    """Copy the K/V of a preempted request to host memory and back."""

    name = "cpu"

    def swap_out(self, blocks, runner):
        data = runner.read_blocks(blocks)
        mx.eval(data)
        return [(host(a), a.dtype) for a in data]

    def swap_in(self, handle, blocks, runner):
        runner.write_blocks(blocks, [device(a, dtype) for a, dtype in handle])


@hookimpl
def register_swap_policies(register):
    register("recompute", RecomputePolicy)
    register("cpu", CPUSwapPolicy)
