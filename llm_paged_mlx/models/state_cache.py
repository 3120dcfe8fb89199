"""Recurrent layers' state (mlx-lm's ``ArraysCache``), kept per sequence beside the K/V blocks.

Hybrid models (Qwen3.5, Qwen3-Next, LFM2, Nemotron-H, Granite 4, Jamba, ...)
mix attention layers with recurrent ones (gated delta rules, Mamba, short
convolutions). A recurrent layer keeps a few arrays per sequence whose size
does not grow with the context (a convolution's last inputs, an SSM state):
it reads them as ``cache[i]`` and replaces them with ``cache[i] = new``, one
row per sequence of its batch.

``PagedStateCache`` keeps each running sequence's state as a row of the batch
that last wrote it. A forward call is bound to its rows' state (``gather``:
that batch itself when the rows are the same sequences in the same order, as
in steady decoding, else a stack of their rows; zeros, or None as mlx-lm's
fresh cache has, for sequences that start) and ``unbind`` hands back what the
layer wrote, which ``keep`` makes the rows' state. Nothing is written into a
pool in place: a step that gathers from an array and scatters into it makes
MLX copy the whole array.
"""

import math
from dataclasses import dataclass
from typing import Optional

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache


@dataclass(frozen=True)
class StateLayout:
    """One recurrent layer's state per sequence: the shape and dtype of each of its ``ArraysCache`` entries
    (None for an entry the layer never sets)."""

    entries: tuple[Optional[tuple[tuple[int, ...], mx.Dtype]], ...]

    @property
    def bytes_per_sequence(self) -> int:
        return sum(dtype.size * math.prod(shape) for shape, dtype in filter(None, self.entries))

    def make_cache(self) -> "PagedStateCache":
        return PagedStateCache(self)


class PagedStateCache:
    """One recurrent layer's per-sequence state, behind mlx-lm's ``ArraysCache`` protocol."""

    left_padding = None

    def __init__(self, layout: StateLayout):
        self.layout = layout
        # Each sequence's state by key (the engine's request id): per entry, (batch, row), or None if unset.
        self.held: dict[int, list[Optional[tuple[mx.array, int]]]] = {}
        self._values: list = []
        self.lengths: Optional[mx.array] = None  # a right-padded call's tokens per row, as mlx-lm's batches

    def gather(self, keys: list[Optional[int]], fresh_as_none: bool) -> list[Optional[mx.array]]:
        """Per entry, the state of a call's rows: row j continues sequence ``keys[j]``, or starts (None: a
        new sequence or a padding row). With ``fresh_as_none``, None for an entry if every row starts."""
        out = []
        for i, entry in enumerate(self.layout.entries):
            sources = [None if key is None else self.held[key][i] for key in keys]
            if entry is None or (fresh_as_none and all(s is None for s in sources)):
                out.append(None)
                continue
            batch = sources[0][0] if sources[0] is not None else None
            same = all(s is not None and s[0] is batch and s[1] == j for j, s in enumerate(sources))
            if same and batch.shape[0] == len(keys):  # the rows of the call that wrote it, in its order
                out.append(batch)
                continue
            zeros = mx.zeros(*entry)
            out.append(mx.stack([zeros if s is None else s[0][s[1]] for s in sources]))
        return out

    def bind(self, states: list[Optional[mx.array]], lengths: Optional[mx.array] = None) -> None:
        """Serve a forward call whose rows start from ``states`` (what ``gather`` returned) and, if it is
        right-padded, hold ``lengths`` tokens each."""
        self._values = list(states)
        self.lengths = lengths

    def unbind(self) -> list[Optional[mx.array]]:
        """End the call: each entry as the layer left it (None for unset entries), in the entry's dtype."""
        out = [None if e is None or v is None else v.astype(e[1]) for v, e in zip(self._values, self.layout.entries)]
        self._values, self.lengths = [], None
        return out

    def keep(self, keys: list[int], states: list[Optional[mx.array]]) -> None:
        """Make row j of ``states`` (what ``unbind`` returned) the state of sequence ``keys[j]``."""
        for j, key in enumerate(keys):
            self.held[key] = [None if s is None else (s, j) for s in states]

    def __getitem__(self, i):
        return self._values[i]

    def __setitem__(self, i, value):
        if self.layout.entries[i] is None:
            raise ValueError(f"a recurrent layer set its state entry {i}, which it left unset when probed")
        self._values[i] = value

    def advance(self, n: int) -> None:
        if self.lengths is not None:
            self.lengths = self.lengths - n

    def make_mask(self, n: int):
        """Which of a call's ``n`` positions hold real tokens (None: all of them)."""
        return None if self.lengths is None else mx.arange(n) < self.lengths[:, None]


def honours_lengths(model, structure_factory) -> bool:
    """Whether the model's recurrent layers leave a right-padded row's state as if it were alone (they read
    ``ArraysCache.lengths``, as mlx-lm's batched prompts set it); ``structure_factory()`` makes its caches.
    A model whose forward fails on such a batch does not."""
    try:
        padded, alone = (_last_row_states(model, structure_factory(), *run) for run in _LENGTHS_PROBE)
    except Exception:
        return False
    return all(mx.allclose(p, a, rtol=1e-3, atol=1e-3).item() for p, a in zip(padded, alone))


# A right-padded batch whose last row holds one token, and that token alone.
_LENGTHS_PROBE = (([[7, 3, 5], [2, 0, 0]], [3, 1]), ([[2]], None))


def _last_row_states(model, structure, tokens, lengths) -> list[mx.array]:
    """What a forward pass leaves in the model's recurrent caches for its last row."""
    flat = [c for entry in structure for c in getattr(entry, "caches", (entry,))]
    for cache in flat:
        if lengths is not None and isinstance(cache, ArraysCache):
            cache.prepare(lengths=lengths)
    model(mx.array(tokens), cache=structure)
    return [a[-1] for c in flat if isinstance(c, ArraysCache) for a in c.cache if a is not None]
