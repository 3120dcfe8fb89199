"""The model self-check at load: the paged path against mlx-lm's own cache path.

A model is served only if the engine has shown, at load, that it computes what
mlx-lm computes. Two sequences of fixed random tokens go through the engine's
runner the way the engine drives it (a prefill in two chunks, one ending
mid-block and one crossing a block boundary; a mixed prefill and decode step;
decode steps of both sequences at their own positions across a block
boundary, compiled when the runner compiles; the long sequence outgrows the
smallest sliding window, and with MLA takes the prompt formulation) and through mlx-lm's
``make_prompt_cache``; the logits must agree within the tolerance of their
dtype, or else with attention computed in float32 on both paths (a model that
routes by a top-k can flip a choice on a rounding difference alone). The verdict depends on the code path, not on the weights, so it is
kept per fingerprint: in the process, and in a JSON file across processes.
"""

import functools
import hashlib
import json
import math
from pathlib import Path
from typing import Optional

import mlx.core as mx
import mlx_lm
import numpy as np
from mlx.utils import tree_flatten
from mlx_lm.models.cache import make_prompt_cache

from .. import verdicts
from ..kernels.dialect import source_dir
from ..models.latent_shape import MIN_SEQUENCE_TOKENS
from ..models.adapt import model_config
from ..models.attention_hook import float32_attention
from .request import Request, SamplingParams
from .scheduler import ScheduledChunk

# The largest relative error (of a logits row, in L2 norm) accepted, by the dtype of the compared values:
# exact models stay well under these, and attention a few percent off goes over them (measured in
# benchmarks/RESULTS.md). Float32 leaves room for MLX's CUDA backend, whose float32 matmuls are TF32-like.
TOLERANCE = {mx.float32: 5e-3, mx.float16: 2e-2, mx.bfloat16: 5e-2}
DECODE_STEPS = 3

_verdicts: dict[str, Optional[str]] = {}  # fingerprint -> None (passed) or the reason for refusing
_UNKNOWN = object()
# The code whose behaviour a verdict is about (with the kernels' sources): a change makes every verdict new.
_OWN_SOURCES = (
    "engine/*.py", "kernels/*.py", "models/adapt.py", "models/attention_hook.py", "models/paged_cache.py",
    "models/quantized_rows.py", "models/softcapped.py", "models/state_cache.py", "models/latent_shape.py",
    "models/merged_projections.py", "models/deferred_rope.py",
)  # fmt: skip


class _NoVerdict(Exception):
    """The check could not run to a comparison (an error that may not recur): it refuses, but is not kept."""


def check_against_mlx_lm(model, runner, verdict_file=None) -> None:
    """Raise ``ValueError(f"{architecture}: reason")`` unless the paged path gives mlx-lm's logits.

    ``runner`` must be fresh: the check writes the first blocks after the null
    block (their contents mean nothing after; no block is held) and leaves its
    compiled traces; a pool too small for the check gets a runner of its own.
    ``verdict_file``, if given, keeps verdicts across processes: an unreadable
    one is ignored and rewritten, one that cannot be written is warned about.
    Only comparisons are kept: a check that fails with an error (out of
    memory, say) refuses the model this time and runs again next time.
    """
    key = fingerprint(model, runner)
    stored = verdicts.read(verdict_file) if verdict_file is not None else {}
    verdict = _verdicts.get(key, stored.get(key, _UNKNOWN))
    if verdict is _UNKNOWN:
        try:
            verdict = _verdict(model, runner)
        except _NoVerdict as e:
            raise ValueError(str(e)) from e.__cause__
    _verdicts[key] = verdict
    if verdict_file is not None:
        verdicts.keep(verdict_file, key, verdict, "the model check")
    if verdict is not None:
        raise ValueError(verdict)


def fingerprint(model, runner) -> str:
    """A hash of what decides the code path: architecture, config, dtypes, the engine's ``code_path`` options
    and kernel, device, versions."""
    config = model_config(model)
    quantized = {
        (type(m).__name__, getattr(m, "bits", None), getattr(m, "group_size", None), getattr(m, "mode", None))
        for _, m in model.named_modules()
        if hasattr(m, "bits")
    }
    facts = {
        "model": f"{type(model).__module__}.{type(model).__qualname__}",
        "config": vars(config) if config is not None else None,
        "parameters": [(name, p.shape, str(p.dtype)) for name, p in tree_flatten(model.parameters())],
        "quantized": sorted(quantized, key=repr),
        "options": runner.config.code_path,  # with MLA, max_num_batched_tokens decides what is decompressed
        "kernel": runner.kv.caches[0].kernel.name,
        "compiled": runner.compile_steps,  # the option, where the kernel can be compiled
        "device": str(mx.default_device()),
        "versions": [mx.__version__, mlx_lm.__version__, _own_code()],
    }
    return hashlib.sha256(json.dumps(facts, sort_keys=True, default=repr).encode()).hexdigest()


@functools.cache
def _own_code() -> str:
    """A hash of this package's code that the paged path runs."""
    root = Path(__file__).resolve().parents[1]
    paths = sorted(source_dir().iterdir())  # the kernels' sources
    for pattern in _OWN_SOURCES:
        paths += sorted(root.glob(pattern))
    return verdicts.code_hash(paths)


def _verdict(model, runner) -> Optional[str]:
    """None if the paged path gives mlx-lm's logits on the check's sequences, else why not.

    Raises ``_NoVerdict`` if either path fails before the logits can be compared.
    """
    arch, size = runner.spec.architecture, runner.block_size
    long, long_len, short, short_len = _check_sequences(model, runner)
    need = 1 + (-(-len(long) // size) + -(-len(short) // size)) * len(runner.groups.windows)  # with the null block
    if runner.kv.num_blocks < need or runner.kv_bits is not None:
        # Quantized K/V are checked at full precision: quantizing them is the pool's and the kernels' business
        # (their tests and the kernels' own first-use checks), not the model's, and mlx-lm's quantized cache
        # does not run on every backend.
        runner = runner.with_pools(need)
    expected = _references(arch, model, long, long_len, short, short_len)
    try:
        got = _paged(runner, long, long_len, short, short_len)
    except Exception as e:
        raise _NoVerdict(f"{arch}: fails on the paged cache: {type(e).__name__}: {e}") from e
    labels = [_label(long_len, i) for i in range(DECODE_STEPS + 1)]
    labels += [_label(short_len, i) for i in range(DECODE_STEPS + 2)]
    # The tolerance of the less precise of the logits and the K/V pools.
    dtype = min(expected[0].dtype, runner.kv.caches[0].dtype, key=lambda d: d.size)
    tolerance = TOLERANCE.get(dtype, TOLERANCE[mx.float32])
    for label, want in zip(labels, expected):
        if mx.any(mx.isnan(want)).item():  # the weights', not the code path's, doing
            raise _NoVerdict(f"{arch}: mlx-lm's own logits hold NaN at {label}")
    if _mismatch(labels, expected, got, [tolerance] * len(labels)) is None:
        return None
    # Some models (random low-precision ones, say) are so sensitive that rounding attention differently
    # moves their logits by more than the tolerance: then twice that movement is allowed.
    with float32_attention():
        rounded = _references(arch, model, long, long_len, short, short_len)
    noise = [_relative_error(want, other) for want, other in zip(expected, rounded)]
    mismatch = _mismatch(labels, expected, got, [max(tolerance, 2 * n) for n in noise])
    if mismatch is None:
        return None
    label, error = mismatch
    reason = (
        f"{arch}: paged attention gives different logits than mlx-lm (relative error {error:.3g} at {label}; "
        f"attention in float32 moves mlx-lm's by {noise[labels.index(label)]:.3g})"
    )
    # A model that routes tokens (to experts, say) by a top-k can jump on a rounding difference that flips
    # one choice. Taking that rounding out (attention in float32 on both paths, over pools of their own)
    # tells such a model from a paged path that computes something else.
    try:
        with float32_attention():
            got = _paged(runner.with_pools(runner.kv.num_blocks), long, long_len, short, short_len)
    except Exception as e:
        raise _NoVerdict(f"{arch}: fails on the paged cache in float32: {type(e).__name__}: {e}") from e
    mismatch = _mismatch(labels, rounded, got, [tolerance] * len(labels))
    if mismatch is None:
        return None
    return reason + f", and {mismatch[1]:.3g} at {mismatch[0]} with attention in float32 on both paths"


def _check_sequences(model, runner) -> tuple[list[int], int, list[int], int]:
    """The check's two sequences (random tokens) and their prompts' lengths.

    The long prompt ends 2 tokens before a block boundary, the short one 1 token before: their decode steps
    cross a boundary at different positions. The short one also decodes in the long one's second prefill step.
    The long one is longer than the smallest sliding window, if there is one, and for MLA long enough to take
    mlx-lm's prompt formulation (``models.latent_shape``), its second chunk continuing a context.
    """
    size = runner.block_size
    windows = [layout.window for layout in runner.spec.attention if layout.window]
    blocks = max(3, -(-min(windows) // size) + 2) if windows else 3
    if runner.spec.latent:
        blocks = max(blocks, -(-(MIN_SEQUENCE_TOKENS + 2) // size))
    long_len, short_len = max(blocks * size - 2, 4), max(size - 1, 2)
    rng = np.random.default_rng(0)
    vocab = runner.spec.vocab_size or 32
    long = rng.integers(0, vocab, long_len + DECODE_STEPS).tolist()
    short = rng.integers(0, vocab, short_len + DECODE_STEPS + 1).tolist()
    return long, long_len, short, short_len


def _mismatch(labels, expected, got, tolerances) -> Optional[tuple[str, float]]:
    """The first row whose relative error passes its tolerance, and that error; None if none does."""
    for label, want, have, tolerance in zip(labels, expected, got, tolerances):
        error = _relative_error(want, have)
        if not error <= tolerance:  # NaN fails too
            return label, error
    return None


def _label(prompt_len: int, step: int) -> str:
    if step == 0:
        return f"the {prompt_len}-token prompt's prefill"
    return f"the {prompt_len}-token prompt's decode step {step} (position {prompt_len + step - 1})"


def _relative_error(want: mx.array, have: mx.array) -> float:
    """The L2 relative error of the finite logits; infinite ones (masked tokens) must be equal."""
    want, have = want.astype(mx.float32), have.astype(mx.float32)
    masked = mx.isinf(want)
    if not mx.array_equal(mx.where(masked, want, 0), mx.where(masked, have, 0)).item():
        return math.inf
    want, have = mx.where(masked, 0, want), mx.where(masked, 0, have)
    return (mx.linalg.norm(have - want) / mx.maximum(mx.linalg.norm(want), 1e-30)).item()


def _references(arch: str, model, long: list[int], long_len: int, short: list[int], short_len: int) -> list[mx.array]:
    """``_reference`` of both sequences (long, then short); ``_NoVerdict`` if mlx-lm's forward fails."""
    try:
        return _reference(model, long, long_len) + _reference(model, short, short_len)
    except Exception as e:
        raise _NoVerdict(f"{arch}: mlx-lm's own forward fails: {type(e).__name__}: {e}") from e


def _reference(model, tokens: list[int], prompt_len: int) -> list[mx.array]:
    """mlx-lm's logits of the prompt's last token, then of each token after it, fed one at a time."""
    cache = make_prompt_cache(model)
    rows = [model(mx.array(tokens[:prompt_len])[None], cache=cache)[0, -1]]
    for token in tokens[prompt_len:]:
        rows.append(model(mx.array([[token]]), cache=cache)[0, -1])
    mx.eval(rows)
    return rows


def _paged(runner, long: list[int], long_len: int, short: list[int], short_len: int) -> list[mx.array]:
    """The runner's logits for the same rows as ``_reference``, in its order (long, then short)."""
    size = runner.block_size
    a = Request(-1, long[:long_len], SamplingParams(), max_total_tokens=len(long))
    b = Request(-2, short[:short_len], SamplingParams(), max_total_tokens=len(short))
    ids = iter(range(1, runner.kv.num_blocks))  # block 0 is the null block
    blocks = {}  # each table's blocks, of every group; windows keep all of theirs here
    for request in (a, b):
        request.tables = runner.groups.new_tables()
        for seq in request.tables:
            blocks[id(seq)] = [next(ids) for _ in range(-(-request.max_total_tokens // size))]

    def chunk(request, count):
        start, slots = request.num_computed, []
        for seq in request.tables:
            seq.table = blocks[id(seq)][: -(-(start + count) // size)]
            slots.append([seq.table[p // size] * size + p % size for p in range(start, start + count)])
        return ScheduledChunk(request, count, slots)

    def step(*chunks):
        logits = runner.forward(list(chunks))
        runner.launch(logits)
        mx.synchronize()
        for c in chunks:
            c.request.num_computed += c.num_tokens
        return [logits[i] for i in range(logits.shape[0])]

    first = size + size // 2  # the long prefill's first chunk ends mid-block, the second crosses a boundary
    try:
        (short_prefill,) = step(chunk(a, first), chunk(b, short_len))
        b.output_token_ids.append(short[short_len])
        short_rows, long_rows = [short_prefill], []
        mixed = step(chunk(b, 1), chunk(a, long_len - first))  # single-token chunks first, as the scheduler orders
        short_rows.append(mixed[0])
        long_rows.append(mixed[1])
        for i in range(DECODE_STEPS):
            a.output_token_ids.append(long[long_len + i])
            b.output_token_ids.append(short[short_len + 1 + i])
            row_a, row_b = step(chunk(a, 1), chunk(b, 1))
            long_rows.append(row_a)
            short_rows.append(row_b)
    finally:
        for request in (a, b):  # what models with recurrent layers keep of them
            runner.kv.states.release(request.request_id)
    return long_rows + short_rows
