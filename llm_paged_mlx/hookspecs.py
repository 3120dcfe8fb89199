"""Hook specifications: how plugins add schedulers, swap policies and attention kernels.

Each hook receives a ``register(name, factory)`` callable. ``factory()`` must
return a new object with the interface described by the hook.
"""

import pluggy

hookspec = pluggy.HookspecMarker("llm_paged_mlx")
hookimpl = pluggy.HookimplMarker("llm_paged_mlx")


@hookspec
def register_schedulers(register):
    """Register scheduling policies: ``key(request)``, optionally ``preempts(waiting, running)`` (see ``engine.scheduler``)."""


@hookspec
def register_swap_policies(register):
    """Register what happens to a preempted request's KV: ``swap_out``, ``swap_in``, optionally ``discard`` (see ``engine.swap``)."""


@hookspec
def register_attention_kernels(register):
    """Register paged attention kernels (see ``kernels.AttentionKernel``)."""
