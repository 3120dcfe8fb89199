"""The verdict of a fused kernel's first-use self-check: use it, or warn and use the portable kernel.

With a verdict file (``verdicts``), a verdict measured once for a kernel, its source and settings, a
configuration, this device, this MLX and the compilers beside it, and this package's kernel code is read back by
later processes, so that each ``llm -m`` does not compile and run every variant again.
"""

import functools
import hashlib
import importlib.metadata
import json
import platform
import warnings
from collections.abc import Callable
from pathlib import Path

import mlx.core as mx

from .. import verdicts
from .dialect import source_dir

_UNKNOWN = object()


def passes(kernel: str, config: str, error: Callable[[], float], tolerance: float, source: str = "",
           verdict_file=None) -> bool:  # fmt: skip
    """Whether ``kernel`` (its name, e.g. "cuda paged attention") may serve ``config``: ``error()``
    measures its relative error against the portable kernel. A compile or launch error, or an error
    above ``tolerance`` (NaN included), warns and returns False. ``source``: the kernel's source and
    settings. With ``verdict_file``, a verdict kept there is used without measuring, and a measured one is
    kept; a compile or launch error is not (it may not recur: memory running out, say)."""
    key = _key(kernel, config, source, tolerance) if verdict_file is not None else None
    verdict = verdicts.read(verdict_file).get(key, _UNKNOWN) if key is not None else _UNKNOWN
    if verdict is _UNKNOWN:
        try:
            measured = error()
        except Exception as exc:  # a compile or launch error: any failure means "don't use it"
            warnings.warn(f"{kernel} kernel failed for {config} ({exc}); using the portable kernel", RuntimeWarning,
                          stacklevel=4)  # fmt: skip
            return False
        verdict = None
        if not measured <= tolerance:
            verdict = f"{kernel} kernel disagrees with the portable kernel for {config} (relative error {measured:.2e})"
        if key is not None:
            verdicts.keep(verdict_file, key, verdict, f"the {kernel} self-check")
    if verdict is not None:
        warnings.warn(f"{verdict}; using the portable kernel", RuntimeWarning, stacklevel=4)
        return False
    return True


def _key(kernel: str, config: str, source: str, tolerance: float):
    """The verdict's fingerprint, or None where it cannot be told apart from another device's or code's (MLX
    names no device, the package's code cannot be read): then nothing is kept or read back."""
    try:
        return fingerprint(kernel, config, source, tolerance)
    except (OSError, LookupError):
        return None


def fingerprint(kernel: str, config: str, source: str, tolerance: float) -> str:
    """A hash of what decides a self-check's verdict: the kernel, its source and settings, the configuration,
    the tolerance, the device, the platform, MLX's version and the compilers and driver beside it, and this
    package's kernel code."""
    facts = {
        "kernel": kernel,
        "config": config,
        "source": hashlib.sha256(source.encode()).hexdigest(),
        "tolerance": tolerance,
        "device": [str(mx.default_device()), *_device_name()],
        "platform": platform.platform(),
        "versions": [mx.__version__, *_toolchain(), _kernel_code()],
    }
    return "kernel " + hashlib.sha256(json.dumps(facts, sort_keys=True).encode()).hexdigest()


def _device_name() -> list[str]:
    """The default device's architecture and name, as MLX reports them (LookupError if it names neither)."""
    try:
        info = mx.device_info()
    except Exception as e:  # a backend that reports nothing
        raise LookupError(f"MLX names no device ({e})") from e
    name = [str(info[field]) for field in ("architecture", "device_name") if field in info]
    if not name:
        raise LookupError("MLX names no device")
    return name


@functools.cache
def _toolchain() -> list[str]:
    """What builds and runs the kernels beside MLX's own version: MLX's backend packages and NVIDIA's (NVRTC among
    them) as installed, and the NVIDIA driver where there is one. (Metal's compiler comes with the OS.)"""
    prefixes = ("mlx-cuda", "mlx-metal", "mlx-cpu", "nvidia-")
    names = ((d.metadata.get("Name") or "", d.version) for d in importlib.metadata.distributions())
    packages = sorted(f"{name.lower()}=={version}" for name, version in names if name.lower().startswith(prefixes))
    try:
        driver = Path("/proc/driver/nvidia/version").read_text().splitlines()[:1]
    except OSError:
        driver = []
    return packages + driver


@functools.cache
def _kernel_code() -> str:
    """A hash of this package's kernels: their sources and the Python that renders, runs and checks them."""
    return verdicts.code_hash(sorted(source_dir().iterdir()) + sorted(Path(__file__).parent.glob("*.py")))
