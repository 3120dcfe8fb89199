"""llm-paged-mlx: a paged-KV inference engine for MLX models, and an llm plugin.

Names are imported on first use, so that loading the llm plugin does not pull
in MLX for every ``llm`` command.
"""

import importlib

from .hookspecs import hookimpl

_EXPORTS = {
    "BlockManager": ".engine.block_manager",
    "Engine": ".engine.engine",
    "EngineConfig": ".engine.config",
    "PagedAttentionLayer": ".layer",
    "RequestOutput": ".engine.output",
    "SamplingParams": ".engine.request",
    "StreamChunk": ".engine.output",
}

__all__ = ["hookimpl", *_EXPORTS]


def __getattr__(name):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name], __name__), name)
    globals()[name] = value
    return value
