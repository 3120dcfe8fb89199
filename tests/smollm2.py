"""Test helper: the converted SmolLM2-135M-Instruct, from the folder the plugin fetches it into."""

import functools
import os
from pathlib import Path

from llm_paged_mlx.catalog import CACHE_ENV, default_model_cache
from llm_paged_mlx.models.default_model import fetch_default_model

# The plugin's folder for the default model ($LLM_PAGED_MLX_CACHE, else paged-mlx/models in llm's user
# directory), read as the tests are collected, before a test points LLM_USER_PATH at a folder of its own:
# the model that `make demo` (or a first `llm -m paged-smollm2`) fetched is the one the tests load, and
# the processes they start (`llm`, tensor-parallel ranks) find it there too.
MODEL_CACHE = default_model_cache()
os.environ.setdefault(CACHE_ENV, str(MODEL_CACHE))


@functools.cache
def smollm2_dir() -> Path:
    """The mlx-lm folder of SmolLM2-135M-Instruct (4-bit, as shipped), fetched on first use."""
    return fetch_default_model(MODEL_CACHE)
