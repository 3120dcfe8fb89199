"""llm-paged-mlx: a paged-KV inference engine for MLX models, and an llm plugin."""

from .engine.block_manager import BlockManager
from .engine.engine import Engine
from .engine.output import RequestOutput, StreamChunk
from .engine.request import SamplingParams
from .hookspecs import hookimpl
from .layer import PagedAttentionLayer

__all__ = [
    "BlockManager",
    "Engine",
    "PagedAttentionLayer",
    "RequestOutput",
    "SamplingParams",
    "StreamChunk",
    "hookimpl",
]
