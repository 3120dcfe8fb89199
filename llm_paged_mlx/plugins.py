"""Loads the built-in and third-party plugins and looks up what they registered.

Third-party packages declare an entry point in the group ``llm_paged_mlx``.
Set ``LLM_PAGED_MLX_LOAD_PLUGINS`` to a comma-separated list of entry-point
names to load only those (an empty string loads none).
"""

import os
from functools import cache

import pluggy

from . import hookspecs

DEFAULT_PLUGINS = (
    "llm_paged_mlx.engine.scheduler",
    "llm_paged_mlx.engine.swap",
    "llm_paged_mlx.kernels.builtin",
)


@cache
def get_plugin_manager() -> pluggy.PluginManager:
    import importlib
    from importlib.metadata import entry_points

    pm = pluggy.PluginManager("llm_paged_mlx")
    pm.add_hookspecs(hookspecs)
    for name in DEFAULT_PLUGINS:
        pm.register(importlib.import_module(name), name)
    allowed = os.environ.get("LLM_PAGED_MLX_LOAD_PLUGINS")
    if allowed is None:
        pm.load_setuptools_entrypoints("llm_paged_mlx")
    else:
        wanted = {name.strip() for name in allowed.split(",") if name.strip()}
        for ep in entry_points(group="llm_paged_mlx"):
            if ep.name in wanted and pm.get_plugin(ep.name) is None:
                pm.register(ep.load(), ep.name)
    return pm


def _collect(hook) -> dict:
    found = {}

    def register(name, factory):
        if name in found:
            raise ValueError(f"{name!r} is registered twice")
        found[name] = factory

    hook(register=register)
    return found


def schedulers() -> dict:
    return _collect(get_plugin_manager().hook.register_schedulers)


def swap_policies() -> dict:
    return _collect(get_plugin_manager().hook.register_swap_policies)


def attention_kernels() -> dict:
    return _collect(get_plugin_manager().hook.register_attention_kernels)


def lookup(kind: str, registry: dict, name: str):
    """The factory registered as ``name``, or a ValueError listing the known names."""
    if name not in registry:
        known = ", ".join(sorted(registry)) or "none"
        raise ValueError(f"unknown {kind} {name!r} (known: {known})")
    return registry[name]
