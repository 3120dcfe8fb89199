"""Paged attention kernels against a float64 numpy reference, on the CPU.

Every case is fresh random data: block tables are random permutations of the
pool, context lengths are ragged (1, non-multiples of the block size), query
heads share KV heads (GQA). Pool positions a row must not see are poisoned, so
reading one shows up in the result. The helpers here are shared with
``test_kernels_cuda.py``.
"""

import json
import warnings

import mlx.core as mx
import numpy as np
import pytest

from models import tiny_model

from llm_paged_mlx import Engine, plugins, verdicts
from llm_paged_mlx.kernels import AttentionPlan, PrefillChunk, fused, select_kernel, self_check
from llm_paged_mlx.kernels.fused import CudaKernel, MetalKernel
from llm_paged_mlx.kernels.dialect import CUDA, read_template
from llm_paged_mlx.kernels.in_place import InPlaceWrites
from llm_paged_mlx.kernels.latent import LatentKernels
from llm_paged_mlx.kernels.portable import QUERY_TILE, PortableKernel, chunk_attention, decode_attention

BIG = 1e30  # stands in for stale K/V that the portable kernel reads but must mask


def make_case(rng, seq_lens, q_heads, kv_heads, dim, block_size, spare_blocks=3, strict=True):
    """Random pools and block tables for sequences of ``seq_lens`` tokens.

    Returns numpy ``(k_pool, v_pool, tables)``: tables are padded with the null
    block 0. Unreferenced blocks hold NaN; positions past a sequence's length in
    its blocks, and block 0, hold NaN if ``strict`` (a fused kernel must not read
    them) or ``BIG`` otherwise (the portable kernel reads and masks them).
    """
    counts = [-(-n // block_size) for n in seq_lens]
    num_blocks = 1 + sum(counts) + spare_blocks
    ids = rng.permutation(np.arange(1, num_blocks))
    width = max(counts) + 1
    tables = np.zeros((len(seq_lens), width), np.int32)
    visible = np.zeros((num_blocks, block_size), bool)
    referenced = np.zeros(num_blocks, bool)
    referenced[0] = True
    start = 0
    for row, (n, count) in enumerate(zip(seq_lens, counts)):
        tables[row, :count] = ids[start : start + count]
        start += count
        referenced[tables[row, :count]] = True
        flat = np.zeros(count * block_size, bool)
        flat[:n] = True
        visible[tables[row, :count]] = flat.reshape(count, block_size)
    shape = (num_blocks, kv_heads, block_size, dim)
    pools = []
    for _ in range(2):
        pool = rng.standard_normal(shape).astype(np.float32)
        hidden = ~visible[:, None, :, None] & np.ones(shape, bool)
        pool[hidden] = np.nan if strict else BIG
        pool[~referenced] = np.nan
        pools.append(pool)
    return pools[0], pools[1], tables


def reference(queries, k_pool, v_pool, tables, lens, scale, window=None, sinks=None, softcap=None):
    """float64 attention of each row's query ``(R, Hq, 1, D)`` over its first ``lens[r]`` tokens: the last
    ``window`` of them if given, with ``sinks`` (a logit per query head, no value) and ``softcap``."""
    rows, q_heads, _, _ = queries.shape
    _, kv_heads, block_size, _ = k_pool.shape
    rep = q_heads // kv_heads
    out = np.zeros((rows, q_heads, 1, v_pool.shape[-1]))
    for r in range(rows):
        n = int(lens[r])
        first = 0 if window is None else max(0, n - window)
        blocks = tables[r, : -(-n // block_size)]
        for h in range(q_heads):
            k = k_pool[blocks, h // rep].reshape(-1, k_pool.shape[-1])[first:n].astype(np.float64)
            v = v_pool[blocks, h // rep].reshape(-1, v_pool.shape[-1])[first:n].astype(np.float64)
            s = k @ queries[r, h, 0].astype(np.float64) * scale
            if softcap is not None:
                s = softcap * np.tanh(s / softcap)
            peak = s.max() if sinks is None else max(s.max(), float(sinks[h]))
            p = np.exp(s - peak)
            total = p.sum() + (0.0 if sinks is None else np.exp(float(sinks[h]) - peak))
            out[r, h, 0] = p @ v / total
    return out


def rel_error(out, ref):
    return float(np.abs(np.array(out.astype(mx.float32)) - ref).max() / np.abs(ref).max())


def make_plan(rng, q_heads, kv_heads, dim, block_size, decode_lens, prefills, strict=True):
    """A step with decode rows and prefill chunks ``(cached, new)``: plan, inputs and reference.

    Returns ``(plan, queries, k_pool, v_pool, row_tables, row_lens)`` with
    numpy arrays; row ``i`` sees the first ``row_lens[i]`` tokens of its table.
    """
    seq_lens = list(decode_lens) + [cached + new for cached, new in prefills]
    k_pool, v_pool, tables = make_case(rng, seq_lens, q_heads, kv_heads, dim, block_size, strict=strict)
    n_dec = len(decode_lens)
    row_tables, row_lens, chunks = [tables[:n_dec]], [np.array(decode_lens)], []
    row = n_dec
    for i, (cached, new) in enumerate(prefills):
        table = tables[n_dec + i]
        used = table[: -(-(cached + new) // block_size)]
        chunks.append(PrefillChunk(row, new, cached + new, mx.array(used)))
        row_tables.append(np.broadcast_to(table, (new, table.shape[0])))
        row_lens.append(np.arange(cached + 1, cached + new + 1))
        row += new
    num_rows = row
    dec_width = max(1, max((-(-n // block_size) for n in decode_lens), default=1))
    plan = AttentionPlan(
        block_size=block_size,
        positions=mx.zeros((num_rows,), mx.int32),
        slots=mx.zeros((num_rows,), mx.int32),
        num_decode=n_dec,
        decode_block_tables=mx.array(tables[:n_dec, :dec_width]),
        decode_context_lens=mx.array(np.array(decode_lens, np.int32)),
        prefills=chunks,
    )
    queries = rng.standard_normal((num_rows, q_heads, 1, dim)).astype(np.float32)
    return plan, queries, k_pool, v_pool, np.concatenate(row_tables), np.concatenate(row_lens)


DECODE_CASES = [
    # q_heads, kv_heads, dim, block_size, context lengths
    (4, 4, 32, 16, [1, 15, 16, 17, 100]),
    (8, 2, 64, 16, [1, 33, 250, 7]),
    (12, 3, 64, 32, [31, 1, 64, 65]),
    (8, 1, 32, 32, [513, 2]),
]


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("q_heads,kv_heads,dim,block_size,lens", DECODE_CASES)
def test_decode_attention_matches_reference(seed, q_heads, kv_heads, dim, block_size, lens):
    rng = np.random.default_rng(seed)
    k_pool, v_pool, tables = make_case(rng, lens, q_heads, kv_heads, dim, block_size, strict=False)
    queries = rng.standard_normal((len(lens), q_heads, 1, dim)).astype(np.float32)
    scale = dim**-0.5
    out = decode_attention(
        mx.array(queries), mx.array(k_pool), mx.array(v_pool), mx.array(tables), mx.array(lens, mx.int32), scale
    )
    assert rel_error(out, reference(queries, k_pool, v_pool, tables, lens, scale)) < 1e-5


def test_decode_attention_chunks_the_gather(monkeypatch):
    """Tables wider than one gather_mm call allows are split into several calls."""
    import llm_paged_mlx.kernels.portable as portable

    monkeypatch.setattr(portable, "MAX_GATHER_PRODUCTS", 7)
    rng = np.random.default_rng(5)
    lens = [70, 3, 129]
    k_pool, v_pool, tables = make_case(rng, lens, 4, 2, 32, 16, strict=False)
    queries = rng.standard_normal((3, 4, 1, 32)).astype(np.float32)
    out = decode_attention(
        mx.array(queries), mx.array(k_pool), mx.array(v_pool), mx.array(tables), mx.array(lens, mx.int32), 0.2
    )
    assert rel_error(out, reference(queries, k_pool, v_pool, tables, lens, 0.2)) < 1e-5


def test_decode_attention_half_precision_on_cpu():
    rng = np.random.default_rng(3)
    lens = [5, 40]
    k_pool, v_pool, tables = make_case(rng, lens, 4, 2, 32, 16, strict=False)
    queries = rng.standard_normal((2, 4, 1, 32)).astype(np.float32)
    # the reference sees the same bf16-rounded inputs
    queries, k_pool, v_pool = (np.array(mx.array(x).astype(mx.bfloat16).astype(mx.float32)) for x in (queries, k_pool, v_pool))
    out = decode_attention(
        mx.array(queries).astype(mx.bfloat16),
        mx.array(k_pool).astype(mx.bfloat16),
        mx.array(v_pool).astype(mx.bfloat16),
        mx.array(tables),
        mx.array(lens, mx.int32),
        32**-0.5,
    )
    assert out.dtype == mx.bfloat16
    assert rel_error(out, reference(queries, k_pool, v_pool, tables, lens, 32**-0.5)) < 2e-2


@pytest.mark.parametrize("seed", [0, 1])
def test_portable_kernel_serves_decode_and_prefill_rows(seed):
    rng = np.random.default_rng(seed)
    plan, queries, k_pool, v_pool, row_tables, row_lens = make_plan(
        rng, 8, 2, 32, 16, decode_lens=[1, 17, 40], prefills=[(20, 5), (0, 7), (0, 1)], strict=False
    )
    out = PortableKernel()(mx.array(queries), mx.array(k_pool), mx.array(v_pool), plan, 0.3)
    assert out.shape == queries.shape
    assert rel_error(out, reference(queries, k_pool, v_pool, row_tables, row_lens, 0.3)) < 1e-5


def test_row_tables_agree_with_the_reference_rows():
    rng = np.random.default_rng(2)
    plan, *_, row_tables, row_lens = make_plan(rng, 4, 4, 32, 16, decode_lens=[3, 33], prefills=[(16, 4)])
    tables, lens = plan.row_tables()
    assert np.array_equal(np.array(lens), row_lens)
    for r, n in enumerate(row_lens):
        used = -(-int(n) // 16)
        assert np.array_equal(np.array(tables)[r, :used], row_tables[r, :used])


@pytest.mark.parametrize("sinks", [False, True])
@pytest.mark.parametrize("n,past", [(QUERY_TILE + 1, 0), (2 * QUERY_TILE + 37, 100), (QUERY_TILE, 50)])
def test_chunk_attention_in_query_tiles_equals_one_call(n, past, sinks, monkeypatch):
    """Tiles of queries, each over the keys up to its last query, give one causal call's values; a chunk after
    ``past`` keys of context included."""
    key = mx.random.key(3)
    kq, kk, kv, ks = mx.random.split(key, 4)
    q = mx.random.normal((1, 4, n, 32), key=kq)
    k, v = (mx.random.normal((1, 4, past + n, 32), key=x) for x in (kk, kv))
    sink_logits = mx.random.normal((4,), key=ks) if sinks else None
    attention = mx.fast.scaled_dot_product_attention
    want = attention(q, k, v, scale=0.2, mask="causal", sinks=sink_logits)
    calls = []

    def recorded(q, k, v, **kwargs):
        calls.append((q.shape[2], k.shape[2]))
        return attention(q, k, v, **kwargs)

    monkeypatch.setattr(mx.fast, "scaled_dot_product_attention", recorded)
    got = chunk_attention(q, k, v, 0.2, "causal", sink_logits, in_full=True)
    assert got.shape == want.shape
    assert mx.allclose(got, want, rtol=1e-5, atol=1e-6).item()
    ends = [min(first + QUERY_TILE, n) for first in range(0, n, QUERY_TILE)]
    assert calls == [(end - first, past + end) for first, end in zip(range(0, n, QUERY_TILE), ends)]


@pytest.mark.skipif(mx.default_device() != mx.cpu, reason="CPU only")
def test_auto_picks_portable_on_cpu():
    assert not CudaKernel().is_available()
    assert not MetalKernel().is_available()
    assert select_kernel("auto").name == "portable"
    assert CudaKernel.auto_priority > PortableKernel.auto_priority
    assert MetalKernel.auto_priority > PortableKernel.auto_priority


def test_a_registered_kernel_must_be_an_attention_kernel(monkeypatch):
    class Duck:  # the interface, without declaring what it supports
        name, auto_priority = "duck", 0

        def is_available(self):
            return True

    monkeypatch.setattr(plugins, "attention_kernels", lambda: {"duck": Duck, "portable": PortableKernel})
    with pytest.raises(ValueError, match="attention kernel 'duck' is a Duck, not an llm_paged_mlx.kernels"):
        select_kernel("duck")
    with pytest.warns(RuntimeWarning, match="attention kernel 'duck' left out of 'auto': .* is a Duck"):
        assert select_kernel("auto").name == "portable"  # one broken plugin does not stop every engine


@pytest.mark.skipif(mx.default_device() != mx.cpu, reason="CPU only")
@pytest.mark.parametrize("kernel_class", [CudaKernel, MetalKernel])
def test_fused_kernel_that_cannot_run_falls_back_with_one_warning(kernel_class):
    """Called where its backend is missing, a fused kernel warns once and answers like portable."""
    rng = np.random.default_rng(4)
    plan, queries, k_pool, v_pool, row_tables, row_lens = make_plan(
        rng, 8, 2, 64, 16, decode_lens=[1, 20], prefills=[(16, 3)], strict=False
    )
    kernel = kernel_class()
    args = (mx.array(queries), mx.array(k_pool), mx.array(v_pool), plan, 0.125)
    with pytest.warns(RuntimeWarning, match="using the portable kernel"):
        out = kernel(*args)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        again = kernel(*args)
    ref = reference(queries, k_pool, v_pool, row_tables, row_lens, 0.125)
    assert rel_error(out, ref) < 1e-5
    assert rel_error(again, ref) < 1e-5


def test_self_check_verdict_warns_once_per_failure_and_takes_nan_as_a_mismatch():
    def broken():
        raise RuntimeError("Failed to compile kernel")

    with pytest.warns(RuntimeWarning, match=r"cuda latent attention kernel failed for dtype=x \(Failed to compile"):
        assert not self_check.passes("cuda latent attention", "dtype=x", broken, 1e-2)
    for error in (float("nan"), 0.5):
        with pytest.warns(RuntimeWarning, match="disagrees with the portable kernel for dtype=x"):
            assert not self_check.passes("cuda latent attention", "dtype=x", lambda: error, 1e-2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert self_check.passes("cuda latent attention", "dtype=x", lambda: 1e-3, 1e-2)


def measured(values: list, value: float):
    """A self-check's measurement that records that it ran."""
    return lambda: values.append(value) or value


def not_measured():
    raise AssertionError("measured again: the kept verdict was not used")


def test_a_self_check_verdict_is_kept_for_later_processes(tmp_path):
    path, runs = tmp_path / "verdicts.json", []
    assert self_check.passes("cuda paged attention", "dtype=x", measured(runs, 1e-3), 1e-2, "v1", path)
    with pytest.warns(RuntimeWarning, match="disagrees with the portable kernel for dtype=y"):
        assert not self_check.passes("cuda paged attention", "dtype=y", measured(runs, 0.5), 1e-2, "v1", path)
    assert runs == [1e-3, 0.5] and len(json.loads(path.read_text())) == 2

    # A later process reads both verdicts back, and warns again of the refusal
    assert self_check.passes("cuda paged attention", "dtype=x", not_measured, 1e-2, "v1", path)
    refusal = r"dtype=y \(relative error 5.00e-01\); using the portable kernel"
    with pytest.warns(RuntimeWarning, match=refusal):
        assert not self_check.passes("cuda paged attention", "dtype=y", not_measured, 1e-2, "v1", path)

    # Another source, kernel or configuration is measured; so is every check without a verdict file
    assert self_check.passes("cuda paged attention", "dtype=x", measured(runs, 2e-3), 1e-2, "v2", path)
    assert self_check.passes("metal paged attention", "dtype=x", measured(runs, 3e-3), 1e-2, "v1", path)
    assert self_check.passes("cuda paged attention", "dtype=x", measured(runs, 4e-3), 1e-2, "v1")
    assert runs[2:] == [2e-3, 3e-3, 4e-3]


def test_a_self_check_that_fails_with_an_error_keeps_no_verdict(tmp_path):
    path = tmp_path / "verdicts.json"

    def out_of_memory():
        raise MemoryError("no room for the check")

    with pytest.warns(RuntimeWarning, match=r"kernel failed for dtype=x \(no room for the check\)"):
        assert not self_check.passes("cuda paged attention", "dtype=x", out_of_memory, 1e-2, "v1", path)
    assert not path.exists()
    runs = []
    assert self_check.passes("cuda paged attention", "dtype=x", measured(runs, 1e-3), 1e-2, "v1", path)
    assert runs == [1e-3]


def test_a_kept_self_check_verdict_is_about_this_device_platform_mlx_and_kernel_code(monkeypatch):
    key = self_check.fingerprint("cuda paged attention", "dtype=x", "v1", 1e-2)
    assert self_check.fingerprint("cuda paged attention", "dtype=x", "v1", 1e-2) == key
    assert self_check.fingerprint("cuda paged attention", "dtype=x", "v1", 1e-3) != key
    for owner, name, other in [
        (self_check, "_device_name", lambda: ["another", "GPU"]),
        (self_check.platform, "platform", lambda: "another OS"),
        (self_check, "_kernel_code", lambda: "another version of the kernels"),
        (self_check, "_toolchain", lambda: ["nvidia-cuda-nvrtc==0.0.1"]),
        (mx, "__version__", "0.0.1"),
    ]:
        with monkeypatch.context() as m:
            m.setattr(owner, name, other)
            assert self_check.fingerprint("cuda paged attention", "dtype=x", "v1", 1e-2) != key, name


def no_device_info():
    raise RuntimeError("no device info on this backend")


@pytest.mark.parametrize("device_info", [no_device_info, lambda: {"memory_size": 1}], ids=["error", "no name"])
def test_without_a_device_name_nothing_is_kept(tmp_path, monkeypatch, device_info):
    monkeypatch.setattr(mx, "device_info", device_info)
    path, runs = tmp_path / "verdicts.json", []
    assert self_check.passes("cuda paged attention", "dtype=x", measured(runs, 1e-3), 1e-2, "v1", path)
    assert self_check.passes("cuda paged attention", "dtype=x", measured(runs, 1e-3), 1e-2, "v1", path)
    assert runs == [1e-3, 1e-3] and not path.exists()


def test_the_kernel_code_s_hash_leaves_out_what_is_not_a_file(tmp_path):
    source = tmp_path / "fused.py"
    source.write_text("code")
    alone = verdicts.code_hash([source])
    (tmp_path / ".#fused.py").symlink_to("an editor's lock, not a file")
    sources = sorted(tmp_path.glob("*.py"))  # as the kernels' code is found
    assert len(sources) == 2 and verdicts.code_hash(sources) == alone


def test_the_fused_kernels_keep_their_verdicts_in_the_engine_s_file(tmp_path, monkeypatch):
    """A fused kernel whose engine has a verdict file checks each configuration once, across instances (as
    across processes): its attention over every variant it may choose, and its in-place write."""
    path, runs = tmp_path / "verdicts.json", []
    assert Engine(tiny_model("llama"), num_blocks=16, verify_model=False, verdict_file=path).kernel.verdict_file == path
    monkeypatch.setattr(fused, "check_error", lambda *args, **kwargs: runs.append(kwargs["warps"]) or 0.0)
    monkeypatch.setattr(InPlaceWrites, "check_error", lambda self, *dtypes: runs.append(dtypes) or 0.0)
    pool = mx.zeros((1, 2, 16, 64), mx.float16)
    kernel = CudaKernel()
    kernel.verdict_file = path
    assert kernel.usable(mx.float16, pool, pool, 8) and kernel.writes.usable(mx.float16, mx.float16, path)
    assert runs == kernel.warp_choices(4) * 2 + [(mx.float16, mx.float16)]  # with and without a reduce pass

    runs.clear()
    again = CudaKernel()
    again.verdict_file = path
    assert again.usable(mx.float16, pool, pool, 8) and again.writes.usable(mx.float16, mx.float16, path)
    assert runs == []
    other = CudaKernel(partition_size=256)  # other settings: checked anew
    other.verdict_file = path
    assert other.usable(mx.float16, pool, pool, 8) and runs == kernel.warp_choices(4) * 2


def test_a_subclass_of_a_fused_kernel_checks_itself_in_every_process(tmp_path, monkeypatch):
    """A plugin's subclass may change what runs (its code is not in the fingerprint): it keeps no verdicts."""

    class PluginKernel(CudaKernel):
        """A plugin's kernel: the built-in code, under a class of its own."""

    path, runs = tmp_path / "verdicts.json", []
    monkeypatch.setattr(fused, "check_error", lambda *args, **kwargs: runs.append(kwargs["warps"]) or 0.0)
    pool = mx.zeros((1, 2, 16, 64), mx.float16)
    for kernel in (CudaKernel(), PluginKernel(), PluginKernel()):
        kernel.verdict_file = path
        assert kernel.usable(mx.float16, pool, pool, 8)
    assert len(runs) == 3 * len(kernel.warp_choices(4)) * 2
    assert len(json.loads(path.read_text())) == 1  # the package's own kernel's


def test_the_latent_kernels_verdict_is_about_the_reduce_kernel_they_run_too(tmp_path, monkeypatch):
    path, runs = tmp_path / "verdicts.json", []
    monkeypatch.setattr(LatentKernels, "supports", lambda self, *args: True)
    monkeypatch.setattr(LatentKernels, "check_error", lambda self, *args: runs.append(self) or 0.0)
    pool = mx.zeros((1, 1, 16, 576), mx.bfloat16)
    shipped = CudaKernel().latent
    changed = CudaKernel(template=read_template() + "// a reduce kernel of another version\n")
    assert changed.latent.reduce_source != shipped.reduce_source
    for latent in (shipped, LatentKernels(CUDA, shipped.reduce_source), changed.latent):
        assert latent.usable(mx.bfloat16, pool, 16, 512, path)
    assert runs == [shipped, changed.latent]
