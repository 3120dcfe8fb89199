"""On Linux, MLX's CPU wheel calls OpenBLAS instead of the slow reference BLAS it bundles.

MLX's Linux wheels carry the reference (netlib) BLAS in ``mlx*.libs/`` and link it. OpenBLAS
(the Debian/Ubuntu package libopenblas0-pthread) computes their matrix products several times
faster (benchmarks/blas_path.py). Python imports this module as it starts
(``llm_paged_mlx_openblas.pth``, installed with llm-paged-mlx) and ``install()`` waits for the
first ``import mlx``: if OpenBLAS is installed and MLX bundles a BLAS, OpenBLAS is loaded just
before MLX, with its symbols global, so that MLX's BLAS and LAPACK calls resolve to it as they
would with ``LD_PRELOAD``. A process that does not import MLX loads nothing.
``LLM_PAGED_MLX_OPENBLAS=0`` keeps the bundled BLAS.

    python -m llm_paged_mlx_openblas    # the BLAS that MLX's matrix products call here

Every Python process of the environment imports this module: until MLX is imported, it uses
nothing that Python has not imported already (not even pathlib).
"""

import os
import sys

ENV = "LLM_PAGED_MLX_OPENBLAS"
# Where Debian and Ubuntu install it (os.uname is not on every platform: Windows has none).
OPENBLAS = f"/usr/lib/{os.uname().machine}-linux-gnu/openblas-pthread/libblas.so.3" if sys.platform == "linux" else ""


def install() -> None:
    """Load OpenBLAS before MLX at MLX's first import, when OpenBLAS is installed and not turned off.

    Once per process, though a venv whose lib64 links to lib has Python read its .pth files twice.
    """
    if (sys.platform == "linux" and os.environ.get(ENV) != "0" and "mlx" not in sys.modules and os.path.isfile(OPENBLAS)
            and not any(isinstance(finder, _BeforeMLX) for finder in sys.meta_path)):
        sys.meta_path.insert(0, _BeforeMLX())


class _BeforeMLX:
    """An import finder that finds nothing: at the import of ``mlx`` it loads OpenBLAS and leaves ``sys.meta_path``."""

    def find_spec(self, name, path=None, target=None):
        if name == "mlx":
            sys.meta_path.remove(self)
            if bundled_blas():
                import ctypes

                try:
                    ctypes.CDLL(OPENBLAS, mode=ctypes.RTLD_GLOBAL)
                except OSError as e:  # a file that does not load must not keep MLX from loading
                    import warnings

                    warnings.warn(f"llm-paged-mlx: MLX keeps its bundled BLAS, as OpenBLAS did not load: {e}")
        return None


def bundled_blas() -> list[str]:
    """The BLAS libraries that MLX's wheels bundle (auditwheel's ``mlx*.libs/libblas-*``), found without importing MLX.

    ``mlx`` is a namespace package: any folder named mlx on sys.path (the current one, say) is a part of
    it, so every part's folder is looked in.
    """
    import glob
    from importlib.util import find_spec

    spec = find_spec("mlx")
    parts = spec.submodule_search_locations if spec is not None and spec.submodule_search_locations else []
    return sorted(path for part in parts
                  for path in glob.glob(os.path.join(glob.escape(os.path.dirname(part)), "mlx*.libs", "libblas-*")))


def blas_in_use() -> str:
    """The library whose ``cblas_sgemm`` MLX calls in this process (this imports MLX)."""
    import ctypes

    import mlx.core  # noqa: F401  (loads MLX, and OpenBLAS before it when install() is on)

    # MLX's library is loaded with local symbols: it resolves a symbol in the global scope (the program,
    # LD_PRELOAD, libraries loaded with global symbols) first, and in its own dependencies after.
    process = ctypes.CDLL(None)
    if not hasattr(process, "cblas_sgemm"):
        (bundled,) = bundled_blas()
        return bundled

    class DlInfo(ctypes.Structure):
        _fields_ = [("dli_fname", ctypes.c_char_p), ("dli_fbase", ctypes.c_void_p),
                    ("dli_sname", ctypes.c_char_p), ("dli_saddr", ctypes.c_void_p)]

    info = DlInfo()
    process.dladdr(ctypes.cast(process.cblas_sgemm, ctypes.c_void_p), ctypes.byref(info))
    return os.path.realpath(info.dli_fname.decode())


if __name__ == "__main__":
    if sys.platform != "linux":
        print(f"MLX uses the BLAS of its {sys.platform} build; nothing to change here")
    else:
        used = blas_in_use()
        if used in bundled_blas():
            print(f"MLX calls the reference BLAS that its wheel bundles (slow): {used}")
        else:
            print(f"MLX calls {'OpenBLAS' if 'openblas' in used.lower() else 'this BLAS'}: {used}")
