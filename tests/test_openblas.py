"""MLX's Linux CPU wheel calls OpenBLAS once it is installed, with nothing to set (llm_paged_mlx_openblas).

Each test starts a Python of this environment without LD_PRELOAD: what brings OpenBLAS in is the
``.pth`` file installed with the package.
"""

import json
import os
import subprocess
import sys

import pytest

import llm_paged_mlx_openblas as openblas

pytestmark = pytest.mark.skipif(
    not (sys.platform == "linux" and os.path.isfile(openblas.OPENBLAS) and openblas.bundled_blas()),
    reason="needs Linux, OpenBLAS (libopenblas0-pthread) and MLX's wheel with the BLAS it bundles")

# Products and an inverse (BLAS and LAPACK) of the same random matrices, against numpy's in float64.
PRODUCTS = """
import json
import mlx.core as mx
import numpy as np

rng = np.random.default_rng(0)
a, b = rng.standard_normal((2, 300, 200)).astype(np.float32), rng.standard_normal((200, 300)).astype(np.float32)
square = rng.standard_normal((64, 64)).astype(np.float32) + 8 * np.eye(64, dtype=np.float32)
product = np.array(mx.array(a) @ mx.array(b))
inverse = np.array(mx.linalg.inv(mx.array(square), stream=mx.cpu))
print(json.dumps({
    "product": float(np.abs(product - a.astype(np.float64) @ b).max()),
    "inverse": float(np.abs(inverse - np.linalg.inv(square.astype(np.float64))).max()),
}))
"""


def python(code: str, cwd=None, **env) -> subprocess.CompletedProcess:
    environment = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", openblas.ENV)}
    run = subprocess.run([sys.executable, "-c", code], cwd=cwd, env={**environment, **env}, capture_output=True,
                         text=True)
    assert run.returncode == 0, run.stderr
    return run


BLAS_IN_USE = "import llm_paged_mlx_openblas; print(llm_paged_mlx_openblas.blas_in_use())"


def test_mlx_calls_openblas():
    assert python(BLAS_IN_USE).stdout.strip() == os.path.realpath(openblas.OPENBLAS)


def test_a_folder_named_mlx_on_the_path_changes_nothing(tmp_path):
    """``mlx`` is a namespace package, and such a folder in the current directory (first on sys.path) is a
    part of it, before the part in site-packages."""
    (tmp_path / "mlx").mkdir()
    assert python(BLAS_IN_USE, cwd=tmp_path).stdout.strip() == os.path.realpath(openblas.OPENBLAS)


def test_an_openblas_that_does_not_load_leaves_mlx_its_bundled_blas(tmp_path):
    broken = tmp_path / "libblas.so.3"
    broken.write_bytes(b"not a library")
    code = f"import llm_paged_mlx_openblas as o; o.OPENBLAS = {str(broken)!r}; print(o.blas_in_use())"
    run = python(code)
    assert run.stdout.strip() in openblas.bundled_blas()
    assert "MLX keeps its bundled BLAS, as OpenBLAS did not load" in run.stderr


def test_turned_off_mlx_calls_the_blas_it_bundles():
    assert python(BLAS_IN_USE, LLM_PAGED_MLX_OPENBLAS="0").stdout.strip() in openblas.bundled_blas()


def test_a_process_that_does_not_import_mlx_loads_no_blas():
    maps = python("print(open('/proc/self/maps').read())").stdout
    assert "blas" not in maps


def test_openblas_computes_what_the_bundled_blas_computes():
    errors = {way: json.loads(python(PRODUCTS, **env).stdout) for way, env in
              {"openblas": {}, "bundled": {"LLM_PAGED_MLX_OPENBLAS": "0"}}.items()}
    for way, error in errors.items():
        assert error["product"] < 1e-4 and error["inverse"] < 1e-5, (way, error)
