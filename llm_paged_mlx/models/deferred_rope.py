"""RoPE left to the paged attention kernel: a decode step rotates its queries and keys as the kernel reads them,
two kernels a layer fewer (vLLM rotates a step's queries and keys in one kernel; here the attention kernel does).

``defer_rope`` puts a ``DeferredRoPE`` around each attention layer's ``rope`` whose layer hands what it rotates
straight on: the queries to ``scaled_dot_product_attention``, the keys to ``update_and_fetch`` (shown on one
token through mlx-lm's caches at load), where the numbers of the model's module are known (``rope_spec``:
``nn.RoPE``, Llama 3's, YaRN's and LongRoPE's, checked against the module); and only if a short prompt then
gives the model's logits exactly with every rotation applied where a cache takes it (an array a layer also
used elsewhere would not be). Within ``deferring()`` (the engine's steps), a ``DeferredRoPE`` returns its input
unrotated and leaves a ``DeferredRotation``, which the layer's paged cache takes (``take``) with the same
array: a kernel that applies RoPE rotates them, and every other path rotates them with the model's own module,
the same operation on the same values. Outside it (mlx-lm's own caches), the module rotates as before.
"""

import contextlib
import threading
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import KVCache, RotatingKVCache, make_prompt_cache
from mlx_lm.models.rope_utils import Llama3RoPE, SuScaledRoPE, YarnRoPE

from ..kernels.rope import RopeSpec
from .attention_hook import HookedCache, original_sdpa

# A module's rotation against its numbers', float32: max |difference| / max |module's|. Float32 angles of
# positions in the tens of thousands differ by their rounding (more than this), where wrong numbers differ by
# about as much as the values themselves.
CHECK_POSITIONS = (0, 1, 37, 1000, 4095)
CHECK_TOLERANCE = 1e-3

_state = threading.local()  # .notes: the rotations left undone in this thread's step (None: not deferring)


def rope_spec(module: nn.Module, head_dim: int) -> RopeSpec | None:
    """The numbers of a RoPE module of a known class, for rows of ``head_dim`` values, if its rotation is theirs
    (compared on random rows at a few positions); else None."""
    kind = type(module)
    if kind is nn.RoPE:
        inv_freqs = module.base ** (-mx.arange(0, module.dims, 2, dtype=mx.float32) / module.dims)
        spec = RopeSpec(module.dims, module.traditional, inv_freqs, position_scale=module.scale)
    elif kind in (Llama3RoPE, YarnRoPE, SuScaledRoPE):
        dims = module.dim if kind is SuScaledRoPE else module.dims
        value_scale = {YarnRoPE: "mscale", SuScaledRoPE: "_scale"}.get(kind)
        value_scale = getattr(module, value_scale) if value_scale else 1.0
        spec = RopeSpec(dims, getattr(module, "traditional", False), 1.0 / module._freqs, value_scale=value_scale)
    else:
        return None
    x = mx.random.normal((len(CHECK_POSITIONS), 2, 1, head_dim), key=mx.random.key(0))
    positions = mx.array(CHECK_POSITIONS, mx.int32)
    want = module(x, offset=positions)
    error = mx.abs(spec.rotate(x, positions) - want).max() / mx.abs(want).max()
    return spec if error.item() <= CHECK_TOLERANCE else None


@dataclass(frozen=True, eq=False)
class DeferredRotation:
    """What a ``DeferredRoPE`` left undone: the rotation of ``x`` at ``offset``."""

    deferred: "DeferredRoPE"
    x: mx.array
    offset: mx.array

    @property
    def spec(self) -> RopeSpec:
        """The rotation's numbers, as a kernel takes them."""
        return self.deferred.spec

    def same(self, other: "DeferredRotation") -> bool:
        """Whether ``other`` rotates by the same RoPE at the same positions."""
        return other.deferred is self.deferred and other.offset is self.offset

    def apply(self, rows: mx.array) -> mx.array:
        """``rows`` (``x``, or its values as decode rows ``(T, heads, D)``) rotated by the model's own module."""
        if rows.ndim == 3:
            return self.deferred.rope(rows[:, :, None], offset=self.offset)[:, :, 0]
        return self.deferred.rope(rows, offset=self.offset)


class DeferredRoPE(nn.Module):
    """A layer's RoPE module, whose rotation ``deferring()`` leaves to the paged cache."""

    def __init__(self, rope: nn.Module, spec: RopeSpec):
        super().__init__()
        self.rope = rope
        self.spec = spec

    def __call__(self, x: mx.array, offset=0, **kwargs) -> mx.array:
        notes = getattr(_state, "notes", None)
        if notes is None or kwargs:
            return self.rope(x, offset=offset, **kwargs)
        notes.append(DeferredRotation(self, x, offset))
        return x


@contextlib.contextmanager
def deferring():
    """Within it (one step of the engine's, in this thread), ``DeferredRoPE`` modules leave their rotations to
    the caches; a rotation no cache took is an error (the layer's attention would have read unrotated rows)."""
    outer, _state.notes = getattr(_state, "notes", None), []
    try:
        yield
        if _state.notes:
            raise RuntimeError(f"RoPE was deferred but not applied in {len(_state.notes)} places: the model "
                               "handed on other arrays than its RoPE's output")  # fmt: skip
    finally:
        _state.notes = outer


def take(x: mx.array) -> DeferredRotation | None:
    """The rotation left undone of exactly ``x`` (the array a ``DeferredRoPE`` returned), taken; else None."""
    notes = getattr(_state, "notes", None) or []
    for i, note in enumerate(notes):
        if note.x is x:
            return notes.pop(i)
    return None


def defer_rope(model: nn.Module) -> int:
    """Put a ``DeferredRoPE`` around each attention layer's ``rope`` that can be deferred; returns how many."""
    owners = [
        m for _, m in model.named_modules()
        if isinstance(m.get("rope"), nn.Module) and not isinstance(m.rope, DeferredRoPE)
        and not isinstance(m, DeferredRoPE)
    ]  # fmt: skip
    if not owners:
        return 0
    specs, deferred = [], []  # one spec for the layers that rotate alike: a step makes one table for them
    for owner, head_dim in _hand_rotations_on(model, owners):
        spec = rope_spec(owner.rope, head_dim)
        if spec is not None:
            known = next((s for s in specs if s.matches(spec)), None)
            if known is None:
                specs.append(spec)
            owner.rope = DeferredRoPE(owner.rope, known or spec)
            deferred.append(owner)
    if deferred and not _same_logits_deferred(model):
        for owner in deferred:
            owner.rope = owner.rope.rope
        return 0
    return len(deferred)


class _RecordingRoPE(nn.Module):
    """The probe's stand-in for a RoPE module: rotates, and keeps what it returned."""

    def __init__(self, rope: nn.Module):
        super().__init__()
        self.rope = rope
        self.outputs: list = []

    def __call__(self, x, offset=0, **kwargs):
        self.outputs.append(self.rope(x, offset=offset, **kwargs))
        return self.outputs[-1]


class _ProbeCache(HookedCache):
    """The probes' cache: mlx-lm's own, keeping the keys written and the queries attended with, and rotating
    those whose rotation was deferred, as a paged cache does."""

    def __init__(self, cache):
        self.cache, self.keys_given, self.queries_given = cache, [], []

    def __getattr__(self, name):
        return getattr(self.cache, name)

    def update_and_fetch(self, keys, values):
        self.keys_given.append(keys)
        rotation = take(keys)
        return self.cache.update_and_fetch(keys if rotation is None else rotation.apply(keys), values)

    def attention(self, queries, keys, values, scale, mask, sinks=None):
        self.queries_given.append(queries)
        rotation = take(queries)
        queries = queries if rotation is None else rotation.apply(queries)
        return original_sdpa(queries, keys, values, cache=self.cache, scale=scale, mask=mask, sinks=sinks)


def _probe_caches(model: nn.Module) -> list:
    """mlx-lm's caches for the model, those of attention layers as ``_ProbeCache``."""
    return [_ProbeCache(c) if type(c) in (KVCache, RotatingKVCache) else c for c in make_prompt_cache(model)]


def _same_logits_deferred(model: nn.Module) -> bool:
    """Whether a short prompt gives the same logits with the model's deferred rotations applied where its caches
    take them as with its layers rotating (mlx-lm's caches; the same operations on the same values)."""
    tokens = mx.array([[0, 1, 2, 3]])
    try:
        want = model(tokens, cache=make_prompt_cache(model))
        with deferring():
            got = model(tokens, cache=_probe_caches(model))
        return mx.array_equal(want, got).item()
    except Exception:  # one that rotates elsewhere (a note left) or cannot run this probe: nothing is deferred
        return False


def _hand_rotations_on(model: nn.Module, owners: list) -> list:
    """``(owner, head dim)`` of the ``owners`` (modules with a ``rope``) whose RoPE, on one token, rotated queries
    then keys that went as they were to one cache's attention and ``update_and_fetch``."""
    recorders = [(owner, _RecordingRoPE(owner.rope)) for owner in owners]
    caches = _probe_caches(model)
    for owner, recorder in recorders:
        owner.rope = recorder
    try:
        mx.eval(model(mx.array([[0]]), cache=caches))
    finally:
        for owner, recorder in recorders:
            owner.rope = recorder.rope
    given = [(c.queries_given, c.keys_given) for c in caches if isinstance(c, _ProbeCache)]
    handed_on = []
    for owner, recorder in recorders:
        if len(recorder.outputs) == 2:
            queries, keys = recorder.outputs
            if any(len(q) == len(k) == 1 and q[0] is queries and k[0] is keys for q, k in given):
                handed_on.append((owner, queries.shape[-1]))
    return handed_on
