"""K/V rows written into their pools in place, from ``csrc/write_rows.in``.

MLX arrays are values: ``pool[index] = rows`` makes a new pool, and reuses the
old one's memory only if nothing else holds it. A GPU backend holds every input
of a step until the step has ended, so a step built and launched while the
step before it runs would copy each pool it writes. The kernel here writes
through its pool inputs instead, and hands the queries on as its output, so the
attention that takes them reads the pools after the writes: GPU backends order
kernels by the arrays they take and give, and a kernel that reads a pool
without taking those queries could run first. ``FusedKernel.write_and_attend``
uses it for steps with prompt chunks whose every read of the pools is its own
row kernel's (a decode step's attention kernel writes its rows itself).

Self-checked before first use on a dtype: the kernel writes rows into pools
that MLX has evaluated, and the pools must then hold them, with every other row
as it was and the queries handed on unchanged. A compile error or any mismatch
(MLX copying an input, for one) warns once and the pools are written as MLX's
scatter writes them.
"""

import hashlib

import mlx.core as mx

from . import self_check
from .dialect import WRITE_TEMPLATE, Dialect, KernelSource, build, read_template, render

THREADS = 256


class InPlaceWrites:
    """The in-place K/V write of one dialect."""

    def __init__(self, dialect: Dialect, template: str | None = None):
        """``template``: kernel source to use instead of ``csrc/``'s."""
        self.dialect = dialect
        self.template = template if template is not None else read_template(WRITE_TEMPLATE)
        self._kernel = None
        self._checked: dict[tuple, bool] = {}

    def usable(self, pool_dtype, queries_dtype, verdict_file=None) -> bool:
        """Whether the kernel passed its self-check on this device for these dtypes (``verdict_file``: see
        ``self_check.passes``)."""
        key = (str(mx.default_device()), pool_dtype, queries_dtype)
        if key not in self._checked:
            config = f"pools {pool_dtype}, queries {queries_dtype}"
            error = lambda: self.check_error(pool_dtype, queries_dtype)  # noqa: E731
            self._checked[key] = self_check.passes(f"{self.dialect.name} in-place K/V write", config, error, 0.0,
                                                   source=self.template, verdict_file=verdict_file)  # fmt: skip
        return self._checked[key]

    def __call__(self, k_pool, v_pool, index, k_rows, v_rows, queries) -> mx.array:
        """Write ``k_rows`` ``(n, DK)`` and ``v_rows`` ``(n, DV)`` into rows ``index`` ``(n,)`` of the flat
        pools ``(rows, DK)`` and ``(rows, DV)``, in place (unchecked); returns ``queries`` as the write's
        output."""
        if self._kernel is None:
            header, body = render(self.template, self.dialect)["write_rows"]
            tag = hashlib.sha1(self.template.encode()).hexdigest()[:12]
            inputs = ["k_pool", "v_pool", "index", "k_rows", "v_rows", "queries"]
            self._kernel = build(KernelSource(f"write_rows_{tag}", inputs, ["queries_out"], header, body), self.dialect)
        n = index.size
        total = n * (k_pool.shape[1] + v_pool.shape[1]) + queries.size
        rows = [index.reshape(n), k_rows.reshape(n, -1), v_rows.reshape(n, -1)]
        (out,) = self._kernel(
            inputs=[k_pool, v_pool, *rows, queries.reshape(-1)],
            template=[("T", k_pool.dtype), ("Q", queries.dtype), ("TG", THREADS)],
            grid=(-(-total // THREADS) * THREADS, 1, 1),
            threadgroup=(THREADS, 1, 1),
            output_shapes=[(queries.size,)],
            output_dtypes=[queries.dtype],
        )
        return out.reshape(queries.shape)

    def check_error(self, pool_dtype, queries_dtype) -> float:
        """Largest difference between what the pools and the handed-on queries hold after a write and what
        they should (0 when the write is right and in place)."""
        key = mx.random.key(0)
        k_pool, v_pool = mx.zeros((7, 24), pool_dtype), mx.zeros((7, 40), pool_dtype)
        mx.eval(k_pool, v_pool)
        index = mx.array([5, 2, 6], mx.int32)
        kk, kv, kq = mx.random.split(key, 3)
        k_rows = mx.random.normal((3, 24), key=kk).astype(pool_dtype)
        v_rows = mx.random.normal((3, 40), key=kv).astype(pool_dtype)
        queries = mx.random.normal((3, 4, 1, 8), key=kq).astype(queries_dtype)
        out = self(k_pool, v_pool, index, k_rows, v_rows, queries)
        mx.eval(out)
        k_want, v_want = mx.zeros((7, 24), pool_dtype), mx.zeros((7, 40), pool_dtype)
        k_want[index] = k_rows
        v_want[index] = v_rows
        pairs = [(k_pool, k_want), (v_pool, v_want), (out, queries)]
        return max(mx.abs(a.astype(mx.float32) - b.astype(mx.float32)).max().item() for a, b in pairs)
