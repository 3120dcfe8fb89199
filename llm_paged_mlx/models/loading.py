"""Load an mlx-lm model from a local folder or a Hugging Face repo, dequantized on the CPU.

MLX's quantized matmul on the CPU backend is about 50x slower than float32, so on the CPU
quantized layers are turned back into float ones by default; on a GPU they stay quantized.
"""

from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx_lm
from huggingface_hub import snapshot_download
from huggingface_hub.errors import HFValidationError, RepositoryNotFoundError
from huggingface_hub.utils import validate_repo_id
from mlx_lm.utils import DEFAULT_ALLOW_PATTERNS
from mlx_lm.utils import dequantize_model as _mlx_lm_dequantize

_DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}


class ModelFetchError(RuntimeError):
    """A model could not be downloaded (no network, unknown repo, failed package download)."""


def load_model(path_or_repo: str, *, dequantize: str | bool = "auto", dtype="float32", lazy: bool = False):
    """Load `(model, tokenizer)` from a local mlx-lm folder or a Hugging Face repo id.

    dequantize="auto" replaces quantized layers by float layers of `dtype` when the default
    device is the CPU; True always does, False never does. `dtype` is "float32" (default),
    "float16" or "bfloat16" (which changes SmolLM2-135M's greedy answers). Raises ValueError
    for a folder without config.json or an architecture mlx-lm does not support, and
    ModelFetchError when a repo cannot be downloaded. The weights are evaluated, so that the model
    runs on any thread (an ``EngineLoop``'s); ``lazy`` leaves them unread until they are evaluated
    (a model sharded first reads only its shard).
    """
    if dequantize not in ("auto", True, False):
        raise ValueError(f"dequantize must be 'auto', True or False, not {dequantize!r}")
    dtype = _as_dtype(dtype)
    path = resolve_model_path(path_or_repo)
    try:
        model, tokenizer = mlx_lm.load(str(path), lazy=lazy)
    except ValueError as e:
        raise ValueError(f"Cannot load model {path_or_repo}: {e}") from e
    if dequantize is True or (dequantize == "auto" and mx.default_device() == mx.cpu):
        dequantize_model(model, dtype)
    if not lazy:  # the dequantized weights too: left lazy, they could be evaluated only on this thread's stream
        mx.eval(model.parameters())
    return model, tokenizer


def resolve_model_path(path_or_repo: str) -> Path:
    """The local folder of a model: `path_or_repo` itself, or its Hugging Face snapshot."""
    path = Path(path_or_repo).expanduser()
    if path.exists():
        if not path.is_dir():
            raise ValueError(f"{path} is a file, not an mlx-lm model folder")
        if not (path / "config.json").is_file():
            raise ValueError(f"{path} has no config.json, so it is not an mlx-lm model folder")
        return path
    try:
        validate_repo_id(path_or_repo)
    except HFValidationError:
        raise ValueError(
            f"{path_or_repo} is neither an existing folder nor a Hugging Face repo id"
        ) from None
    try:
        return Path(snapshot_download(path_or_repo, allow_patterns=DEFAULT_ALLOW_PATTERNS))
    except RepositoryNotFoundError:
        raise ModelFetchError(
            f"Hugging Face repo {path_or_repo} was not found (or is private or gated)"
        ) from None
    except OSError as e:  # HTTP errors, no network, offline mode without a cached copy
        lines = str(e).strip().splitlines()
        reason = lines[0].removeprefix("Got: ") if lines else type(e).__name__
        raise ModelFetchError(
            f"Could not download {path_or_repo} from Hugging Face: {reason}"
        ) from e


def dequantize_model(model: nn.Module, dtype="float32") -> nn.Module:
    """Replace every quantized layer of `model` by a float one and cast it all to `dtype`."""
    dtype = _as_dtype(dtype)
    # Cast scales and biases first so that the weights are dequantized in `dtype`, not in
    # the (often lower) precision of the scales.
    for _, module in model.named_modules():
        for name in ("scales", "biases"):
            value = module.get(name)
            if isinstance(value, mx.array) and mx.issubdtype(value.dtype, mx.floating):
                module[name] = value.astype(dtype)
    _mlx_lm_dequantize(model)
    model.set_dtype(dtype)
    return model


def _as_dtype(dtype) -> mx.Dtype:
    for name, value in _DTYPES.items():
        if dtype in (name, value):
            return value
    raise ValueError(f"dtype must be one of {', '.join(_DTYPES)}, not {dtype!r}")
