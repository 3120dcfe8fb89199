"""Block tables per group of attention layers, so that sliding-window layers return the blocks they have passed.

Layers that attend alike share one block table. A model whose layers all see
the whole context has one group. A model with sliding-window layers
(Gemma 3, gpt-oss, Cohere 2, ...) gets groups of its full-attention layers and
groups of its windowed layers, each with a table of its own per sequence; a
windowed group's table returns a block as soon as no query to come can reach
it. (vLLM's hybrid KV cache manager does the same.)

Every group draws blocks from the one block manager, in one id space: a block
holds a run of ``block_size`` tokens for the layers of one group. The i-th
layer of every group keeps its K/V in the i-th of ``size`` pool arrays
(shared), so a block is the same size whatever group holds it, and swapping,
copy-on-write and the pool's growth stay blind to groups. Groups hold the same
number of layers: the fewest a kind of layer has; a kind whose count that does
not divide leaves the last of its groups with empty places. Layers that differ
in shape (K/V heads, head sizes, dtype) or cache latents cannot share arrays:
such models keep one group, and their windowed layers keep every block.

A request's tables are used through ``engine.kv_coordinator``.
"""

import sys
from dataclasses import dataclass
from typing import Optional, Sequence

from .block_manager import SequenceBlocks, WindowedBlocks


@dataclass(frozen=True)
class KVGroups:
    windows: tuple[Optional[int], ...]  # each group's window, None for full attention
    layer_groups: tuple[int, ...]  # each attention layer's group
    layer_places: tuple[int, ...]  # each attention layer's pool array (its place in its group)
    size: int  # layers per group

    @property
    def bounded(self) -> bool:
        """Whether some group returns the blocks its window has passed."""
        return any(window is not None for window in self.windows)

    def new_tables(self) -> list[SequenceBlocks]:
        """Empty tables for a new sequence, one per group."""
        return [SequenceBlocks(root=_root(g)) if window is None else WindowedBlocks(window=window, root=_root(g))
                for g, window in enumerate(self.windows)]  # fmt: skip

    def blocks_for(self, num_tokens: int, block_size: int) -> int:
        """The blocks a sequence of ``num_tokens`` tokens holds between steps, over all its tables."""
        full = -(-num_tokens // block_size)
        return sum(full if w is None else min(full, -(-w // block_size) + 1) for w in self.windows)

    def max_tokens(self, num_blocks: int, block_size: int, chunk_tokens: int) -> int:
        """The longest sequence that ``num_blocks`` blocks hold, its windowed tables taking a step's
        ``chunk_tokens`` beyond their windows."""
        caps = [None if w is None else -(-(w + chunk_tokens) // block_size) + 1 for w in self.windows]

        def fits(n: int) -> bool:  # a sequence of n blocks
            return sum(n if cap is None else min(n, cap) for cap in caps) <= num_blocks

        if None not in caps and fits(max(caps)):  # every table keeps its window only
            return sys.maxsize
        low, high = 0, num_blocks  # fits(low), and not fits(high + 1)
        while low < high:
            middle = (low + high + 1) // 2
            low, high = (middle, high) if fits(middle) else (low, middle - 1)
        return low * block_size


def kv_groups(windows: Sequence[Optional[int]], uniform: bool) -> KVGroups:
    """The groups of attention layers with the given windows; ``uniform``: whether their pools have one shape."""
    count = len(windows)
    if not uniform or not any(windows):
        return KVGroups((None,), (0,) * count, tuple(range(count)), count)
    kinds = sorted(set(windows), key=lambda w: -1 if w is None else w)
    size = min(list(windows).count(kind) for kind in kinds)
    groups, layer_groups, layer_places = [], [0] * count, [0] * count
    for kind in kinds:
        members = [i for i, window in enumerate(windows) if window == kind]
        for start in range(0, len(members), size):
            for place, layer in enumerate(members[start : start + size]):
                layer_groups[layer], layer_places[layer] = len(groups), place
            groups.append(kind)
    return KVGroups(tuple(groups), tuple(layer_groups), tuple(layer_places), size)


FULL_ATTENTION = KVGroups((None,), (), (), 0)  # one group of layers that see the whole context


def _root(group: int) -> Optional[bytes]:
    """What a group's first block hash follows: its K/V are other layers' than another group's."""
    return None if group == 0 else b"group %d" % group
