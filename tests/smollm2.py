"""Test helper: the converted SmolLM2-135M-Instruct, fetched once into a persistent cache."""

import functools
import os
from pathlib import Path

from llm_paged_mlx.models.default_model import fetch_default_model


@functools.cache
def smollm2_dir() -> Path:
    """The mlx-lm folder of SmolLM2-135M-Instruct (4-bit, as shipped), fetched on first use.

    The cache is $LLM_PAGED_MLX_CACHE, else ~/.cache/llm-paged-mlx/models, so CI runs on one
    machine download and convert it only once.
    """
    cache = os.environ.get("LLM_PAGED_MLX_CACHE") or Path.home() / ".cache/llm-paged-mlx/models"
    return fetch_default_model(Path(cache))
