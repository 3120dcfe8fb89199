"""The model runner: runs one step's forward pass of the model over its K/V pools (``engine.kv_pools``).

A step whose every row is a single query (all decode steps, and prefill steps
a kernel serves as rows) runs through one ``mx.compile``-d function per
padded shape: rows and block-table width are rounded up to a few sizes per
power of two, the padding rows write to and read from the null block, and the
K/V pools go in and come back as arrays, updated in place. Other steps build
their graph eagerly. A compiled step replays its trace instead of running the
model's Python code and fuses elementwise operations: less host work, which is
most of a GPU step for small models (benchmarks/RESULTS.md).

Models with recurrent layers (``models.state_cache``) cannot take a prefill
chunk as rows: a recurrence runs along a sequence's tokens. Their steps run
the single-token chunks as rows of one call and the longer chunks as
sequences, right-padded into calls of shape ``(B, L)``, and keep each running
sequence's state (``engine.states``). MLA models run the prompt chunks of
requests that decompressing the context serves with less arithmetic as
sequences too, one chunk a call (``models.latent_shape``); their other chunks
stay rows.
"""

import functools
import warnings
from typing import Optional

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import make_prompt_cache

from ..kernels.plan import AttentionPlan, LayerPacer, PrefillChunk, paces_layers
from ..kernels.portable import PREFILL_ATTENTION_BYTES
from ..models.latent_shape import MIN_SEQUENCE_TOKENS, latent_shape
from ..models.adapt import ModelSpec
from ..models.deferred_rope import deferring
from ..models.paged_cache import LayerLayout, PagedLayerCache
from ..models.state_cache import honours_lengths
from .block_manager import NULL_BLOCK, SequenceBlocks
from .config import EngineConfig
from .kv_groups import KVGroups, kv_groups
from .kv_pools import KVPools
from .scheduler import ScheduledChunk

# Each traced shape keeps its graph (about 3 MB for a 28-layer model): past this many
# shapes the traces are dropped and shapes are traced again as they come.
MAX_TRACED_SHAPES = 32


def attention_groups(layouts: list[LayerLayout]) -> KVGroups:
    """The groups of the model's attention layers (``engine.kv_groups``): windowed layers apart when every
    layer's pool has one shape."""
    shapes = {(layout.num_kv_heads, layout.k_dim, layout.v_dim, layout.dtype, layout.latent) for layout in layouts}
    return kv_groups([layout.window for layout in layouts], uniform=len(shapes) == 1)


def padded_size(n: int) -> int:
    """``n`` rounded up to one of four sizes per power of two (exact up to 7): at most 25% more."""
    step = 1 << max(0, n.bit_length() - 3)
    return -(-n // step) * step


def table_rows(seqs: list[SequenceBlocks], width: int) -> np.ndarray:
    """The sequences' block tables as rows of ``width`` entries, null past each table's end and before its
    ``live_from`` (a windowed table shows its window's blocks only)."""
    null = NULL_BLOCK
    rows = [[null] * seq.live_from + seq.table[seq.live_from :] + [null] * (width - len(seq.table)) for seq in seqs]
    return np.array(rows, dtype=np.int32)


class ModelRunner:
    def __init__(self, model, spec: ModelSpec, num_blocks: int, kernel, config: EngineConfig):
        """``spec``: the model's (``check_model``); ``config``: the engine's (its ``block_size``, ``kv_bits``
        and ``kv_group_size``, ``compile_steps``, and ``max_num_batched_tokens``, the most tokens of one
        request a step takes)."""
        self.model, self.spec, self.config = model, spec, config
        self.chunk_tokens = config.max_num_batched_tokens
        self.block_size = config.block_size
        self.kv_bits = config.kv_bits
        self.groups = attention_groups(spec.attention)
        self.kv = KVPools(model, spec.caches, num_blocks, kernel, config, self.groups)
        # Whether prefill chunks of several sequences can share a right-padded call.
        self._pads_sequences = bool(self.kv.states) and honours_lengths(model, lambda: make_prompt_cache(model))
        self.split = spec.projects_sampled_rows_only
        self.compile_steps = config.compile_steps and kernel.compilable
        self._compiled_rows = None
        self._traced_shapes: set[tuple[int, int, bool, bool]] = set()
        self._prefill_as_rows = kernel.prefill_as_rows
        latent = [layout for layout in spec.attention if layout.latent]
        self._latent = latent_shape(model, latent[0].dtype) if latent else None
        self._owns_pools = len(self.kv.owners) == len(self.kv.caches)
        # Compiled steps may write K/V in place where each layer owns its pools (AttentionPlan.in_place).
        self._in_place = self._owns_pools and kernel.in_place_writes

    def with_pools(self, num_blocks: int) -> "ModelRunner":
        """A runner like this one over full-precision pools of its own of ``num_blocks`` blocks."""
        kernel = self.kv.caches[0].kernel
        return ModelRunner(self.model, self.spec, num_blocks, kernel, self.config.replace(kv_bits=None))

    @property
    def writes_in_place(self) -> bool:
        """Whether decode steps write K/V into the pools in place: then a step launched while another runs
        copies no pool. The kernel's writes are, if the last step traced made them so, every layer; or MLX's
        scatters are (``scatters_in_place``)."""
        caches = self.kv.caches
        kernel_writes = self._in_place and bool(caches) and all(c.decodes_in_place for c in caches)
        return kernel_writes or self.scatters_in_place

    @property
    def scatters_in_place(self) -> bool:
        """Whether MLX's scatter writes a decode step's K/V in place while the step before it runs: on the CPU,
        where each layer owns its pools. A CPU stream runs its operations in order, lets go of each one's
        inputs as it ends, and holds the host back once about fifty are queued, so a step has long read a
        layer's pools when the next step's write to them is encoded, if nothing else holds them (``launch``).
        """
        return self._owns_pools and mx.default_device() == mx.cpu

    def grow(self, num_blocks: int) -> None:
        """Grow the pools to ``num_blocks`` blocks, keeping their contents; steps are traced anew."""
        self.kv.resize(num_blocks)
        self._compiled_rows = None
        self._traced_shapes.clear()

    def forward(self, chunks: list[ScheduledChunk], input_tokens: Optional[mx.array] = None,
                project: bool = True) -> mx.array:  # fmt: skip
        """Logits ``(S, vocab)`` for the chunks that complete their request, in chunk order (a row for each of
        a chunk's ``num_sampled`` positions); without ``project``, what ``project`` turns into them.

        ``chunks`` must list single-token chunks first. ``input_tokens``, if
        given, is the step's tokens as an array (each chunk's, in chunk order;
        not for chunks that run as sequences), for tokens not yet read back
        from the device. The K/V writes stay lazy until ``launch`` starts them
        with the sampled tokens.
        """
        sample_rows, row = [], 0
        for chunk in chunks:
            row += chunk.num_tokens
            sample_rows += range(row - chunk.num_sampled, row)
        if self.compile_steps and all(self._as_rows(c) for c in chunks):
            hidden = self._forward_rows(chunks, input_tokens)
        else:
            hidden = self._forward_uncompiled(chunks, input_tokens)
        count = len(sample_rows)
        if count == 0 or sample_rows[-1] == count - 1:  # rows 0..count-1 (decode steps): a slice, no gather
            hidden = hidden[:count, 0]
        else:
            hidden = hidden[mx.array(sample_rows, dtype=mx.int32), 0]
        return self.project(hidden) if project else hidden

    def row_logits(self, chunks: list[ScheduledChunk], input_tokens: mx.array) -> mx.array:
        """Logits ``(len(chunks), vocab)`` of single-token ``chunks`` whatever their position (a draft model's
        passes), their tokens ``input_tokens``."""
        if self.compile_steps:
            hidden = self._forward_rows(chunks, input_tokens)
        else:
            hidden = self._forward_eager(chunks, input_tokens)
        return self.project(hidden[: len(chunks), 0])

    def project(self, hidden: mx.array) -> mx.array:
        """Logits of the model's hidden rows (split architectures; the others' body gives logits)."""
        if not self.split:
            return hidden
        if self.model.args.tie_word_embeddings:
            return self.model.model.embed_tokens.as_linear(hidden)
        return self.model.lm_head(hidden)

    def launch(self, *outputs, decode: bool = False) -> None:
        """Start evaluating the step (the given outputs and every pool write) without waiting for it; ``decode``:
        every row of the step is a sequence's one new token.

        Where MLX's scatters write in place, a decode step leaves the pools out: MLX holds what it is asked for
        until the whole step has ended, and the next step's writes, launched meanwhile, would copy the pools.
        A decode step's attention reads every pool it writes, so its outputs start the writes (a prompt chunk
        may attend to its own rows and leave its writes unread).
        """
        pools = () if decode and self.scatters_in_place else self.kv.arrays()
        mx.async_eval(*outputs, pools, self.kv.states.take_written())  # lazy states hold activations
        for cache in self.kv.caches:
            cache.plan = None

    def _body(self, inputs: mx.array, plans: list[AttentionPlan]) -> mx.array:
        """The model up to the vocabulary projection (split architectures) or with it; ``plans``: one per
        group of layers."""
        for cache, group in zip(self.kv.caches, self.groups.layer_groups):
            cache.plan = plans[group]
        try:
            with deferring():  # decode steps' RoPE in the attention kernel, where it rotates (``deferred_rope``)
                out = (self.model.model if self.split else self.model)(inputs, cache=self.kv.model_caches)
        except BaseException:
            for cache in self.kv.caches:  # rows of a failed call (or of a failed trace's placeholders)
                cache.drop_pending()
            raise
        for cache in self.kv.caches:  # K/V rows a layer did not attend with: a write must not be lost
            cache.write_pending()
        return out

    def _as_rows(self, chunk: ScheduledChunk) -> bool:
        """Whether the chunk's tokens can be served as single-query rows (not if it attends to its own K/V
        before quantization: rows read every key from the pool)."""
        if chunk.num_tokens == 1:
            return True
        attends_own_rows = self.kv_bits is not None and PagedLayerCache.prompts_attend_unquantized
        if self._as_sequence(chunk) or attends_own_rows:
            return False
        end = chunk.start + chunk.num_tokens
        return self._prefill_as_rows is not None and self._prefill_as_rows(chunk.num_tokens, end)

    def _as_sequence(self, chunk: ScheduledChunk) -> bool:
        """Whether the chunk runs as a sequence: a recurrence runs along it, or MLA decompresses its context."""
        if chunk.num_tokens == 1:
            return False
        if self.kv.states:
            return True
        return self._latent is not None and self._decompresses(chunk.request)

    def _decompresses(self, request) -> bool:
        """Whether an MLA request's chunks of several tokens take mlx-lm's prompt formulation: decided on the
        request (its prompt tokens the prefix cache did not hold, in chunks of at most ``chunk_tokens``), not on
        each chunk."""
        prompt = len(request.prompt_token_ids)
        new = prompt - request.num_cached_tokens
        return new >= MIN_SEQUENCE_TOKENS and self._latent.decompresses(
            min(new, self.chunk_tokens), prompt, PREFILL_ATTENTION_BYTES
        )

    def _rows_body(self, decode: bool, in_place: bool, tokens, positions, slots, block_tables, context_lens, pools,
                   states):  # fmt: skip
        """The traced step: every row one query; takes and returns the pools and the rows' recurrent state.
        ``decode``: every row is its sequence's one new token; ``in_place``: see ``AttentionPlan``; ``slots``
        and ``block_tables``: one per group of layers."""
        self.kv.set_arrays(pools)
        rows = tokens.shape[0]
        plans = [
            AttentionPlan(
                self.block_size, positions, s, rows, tables, context_lens, one_token_per_sequence=decode,
                in_place=in_place,
            )
            for s, tables in zip(slots, block_tables)
        ]
        self.kv.states.bind_flat(states)
        hidden = self._body(tokens[:, None], plans)
        return hidden, self.kv.arrays(), self.kv.states.unbind_flat()

    def _forward_rows(self, chunks, input_tokens, in_place: bool = True) -> mx.array:
        """``in_place``: unless other calls of the step write the same pools (see ``AttentionPlan.in_place``)."""
        counts = [c.num_tokens for c in chunks]
        num_rows = sum(counts)
        rows, width = padded_size(num_rows), padded_size(max(len(c.request.blocks.table) for c in chunks))
        groups = len(self.groups.windows)
        # Padding rows: token 0 at position 0, written to and read from the null block.
        tokens, positions = (np.zeros(rows, dtype=np.int32) for _ in range(2))
        if input_tokens is None:
            tokens[:num_rows] = [t for c in chunks for t in c.token_ids()]
        positions[:num_rows] = [p for c in chunks for p in range(c.start, c.start + c.num_tokens)]
        slots = np.zeros((groups, rows), dtype=np.int32)
        block_tables = np.zeros((groups, rows, width), dtype=np.int32)
        for group in range(groups):
            slots[group, :num_rows] = [s for c in chunks for s in c.slots[group]]
            tables = table_rows([c.request.tables[group] for c in chunks], width)
            block_tables[group, :num_rows] = np.repeat(tables, counts, axis=0)  # a chunk's rows share its table
        padded = mx.array(tokens) if input_tokens is None else mx.pad(input_tokens, (0, rows - num_rows))
        # Each row sees its context up to and including its own position.
        slot_arrays, table_arrays = [mx.array(s) for s in slots], [mx.array(t) for t in block_tables]
        arrays = [padded, mx.array(positions), slot_arrays, table_arrays, mx.array(positions + 1)]
        pools = self.kv.arrays()
        states = self.kv.states.gather_flat(self._state_keys(chunks) + [None] * (rows - num_rows))
        in_place = in_place and self._in_place
        shape = (rows, width, max(counts) == 1, in_place)
        traced = shape in self._traced_shapes
        try:
            hidden, new_pools, new_states = self._compiled_for(shape)(*arrays, pools, states)
        except BaseException as e:
            self.kv.set_arrays(pools)  # a failed trace must not leave its placeholders in the caches
            self.kv.states.abandon_call()
            if traced or not isinstance(e, Exception):
                raise
            self._traced_shapes.discard(shape)
            self.compile_steps = False
            try:
                hidden = self._forward_uncompiled(chunks, input_tokens)
            except BaseException:  # it fails eagerly too: the trace was not to blame
                self.compile_steps = True
                raise
            # The model's code cannot be traced (it reads array values, say): run its steps eagerly.
            warnings.warn(f"steps of this model cannot be compiled ({e}); running them eagerly", RuntimeWarning, stacklevel=2)
            return hidden
        self.kv.set_arrays(new_pools)
        if in_place:
            self.kv.keep_before_in_place(pools)
        self.kv.states.keep_flat([c.request.request_id for c in chunks], new_states)
        return hidden

    def _compiled_for(self, shape: tuple[int, int, bool, bool]):
        """The compiled step for ``(rows, table width, decode, in_place)`` (see ``_rows_body``)."""
        if shape not in self._traced_shapes:
            if self._compiled_rows is None or len(self._traced_shapes) >= MAX_TRACED_SHAPES:
                self._compiled_rows = {}  # new functions: the old traces go
                self._traced_shapes.clear()
            self._traced_shapes.add(shape)
        kind = shape[2:]
        if kind not in self._compiled_rows:
            self._compiled_rows[kind] = mx.compile(functools.partial(self._rows_body, *kind))
        return self._compiled_rows[kind]

    def _forward_calls(self, chunks, input_tokens) -> mx.array:
        """A step with chunks to run as sequences (``_as_sequence``): the other chunks as rows of one call
        (compiled if they are all single tokens), then those as sequences, right-padded in calls of similar
        lengths (one call each unless the model's recurrent layers take padding)."""
        as_sequence = [self._as_sequence(c) for c in chunks]
        in_rows = [c for c, sequence in zip(chunks, as_sequence) if not sequence]
        parts, calls = {}, []  # each chunk's hidden rows
        if in_rows and self.compile_steps and all(c.num_tokens == 1 for c in in_rows):
            hidden = self._forward_rows(in_rows, input_tokens, in_place=False)  # the sequences write the pools too
            parts.update((id(c), hidden[i : i + 1]) for i, c in enumerate(in_rows))
        elif in_rows:
            calls.append((in_rows, functools.partial(self._forward_eager, in_rows, input_tokens)))
        for group in self._sequence_groups([c for c, sequence in zip(chunks, as_sequence) if sequence]):
            calls.append((group, functools.partial(self._forward_sequences, group)))
        for group, call in calls:
            lengths = None if group is in_rows or len(group) == 1 else [c.num_tokens for c in group]
            with self.kv.states.bound(self._state_keys(group), [c.request.request_id for c in group], lengths):
                hidden = call()
            start = 0
            for chunk in group:
                parts[id(chunk)] = hidden[start : start + chunk.num_tokens]
                start += chunk.num_tokens
        hidden = [parts[id(c)] for c in chunks]
        return mx.concatenate(hidden) if len(hidden) > 1 else hidden[0]

    def _sequence_groups(self, chunks: list[ScheduledChunk]) -> list[list[ScheduledChunk]]:
        """Chunks to run as one right-padded call each: longest first, each call as large as keeps its
        padded tokens within twice its chunks' own. (Few calls matter: on backends without mlx-lm's
        recurrence kernels a call loops over its length in Python.)"""
        if not self._pads_sequences:
            return [[c] for c in chunks]
        groups: list[list[ScheduledChunk]] = []
        for chunk in sorted(chunks, key=lambda c: -c.num_tokens):
            group = groups[-1] if groups else []
            tokens = sum(c.num_tokens for c in group) + chunk.num_tokens
            if group and (len(group) + 1) * group[0].num_tokens <= 2 * tokens:
                group.append(chunk)
            else:
                groups.append([chunk])
        return groups

    def _forward_sequences(self, group: list[ScheduledChunk]) -> mx.array:
        """Chunks of several tokens as the rows of a ``(B, L)`` call, right-padded; their hidden rows
        ``(T, 1, D)``, chunk after chunk."""
        length = max(c.num_tokens for c in group)
        groups = range(len(self.groups.windows))
        tokens = np.zeros((len(group), length), dtype=np.int32)
        positions, rows, starts = [], [], []
        slots, prefills = [[] for _ in groups], [[] for _ in groups]
        for b, chunk in enumerate(group):
            n, start = chunk.num_tokens, chunk.start
            tokens[b, :n] = chunk.token_ids()
            for g in groups:
                prefills[g].append(self._prefill_chunk(chunk, len(positions), g))
                slots[g] += chunk.slots[g]
            positions += range(start, start + n)
            rows += range(b * length, b * length + n)
            starts.append(start)
        positions, starts, rows = (mx.array(a, dtype=mx.int32) for a in (positions, starts, rows))
        empty_tables, empty_lens = mx.zeros((0, 0), dtype=mx.int32), mx.zeros((0,), dtype=mx.int32)
        plans = [
            AttentionPlan(
                self.block_size, positions, mx.array(slots[g], dtype=mx.int32), 0, empty_tables, empty_lens,
                prefills[g], sequence_starts=starts, sequence_rows=rows,
            )
            for g in groups
        ]  # fmt: skip
        hidden = self._body(mx.array(tokens), plans)
        return hidden.reshape(-1, 1, hidden.shape[-1])[rows]

    def _prefill_chunk(self, chunk: ScheduledChunk, row: int, group: int) -> PrefillChunk:
        """The plan's entry, for one group of layers, for a chunk of several tokens starting at ``row``."""
        start, n = chunk.start, chunk.num_tokens
        used = -(-(start + n) // self.block_size)  # blocks its last token's context spans
        table = chunk.request.tables[group].table[:used]
        return PrefillChunk(row, n, start + n, mx.array(table, dtype=mx.int32))

    @staticmethod
    def _state_keys(chunks: list[ScheduledChunk]) -> list[Optional[int]]:
        """Whose recurrent state each chunk continues: its request's, or none for a request that starts."""
        return [c.request.request_id if c.request.num_computed else None for c in chunks]

    def _forward_uncompiled(self, chunks, input_tokens) -> mx.array:
        if self.kv.states or any(self._as_sequence(c) for c in chunks):  # recurrent state is bound around calls
            return self._forward_calls(chunks, input_tokens)
        return self._forward_eager(chunks, input_tokens)

    def _forward_eager(self, chunks, input_tokens) -> mx.array:
        groups = range(len(self.groups.windows))
        tokens, positions = [], []
        slots, prefills = [[] for _ in groups], [[] for _ in groups]
        decode = [c for c in chunks if c.num_tokens == 1]
        width = max((len(c.request.blocks.table) for c in decode), default=0)
        decode_tables = np.zeros((len(groups), len(decode), width), dtype=np.int32)
        decode_lens = np.zeros(len(decode), dtype=np.int32)
        for chunk in chunks:
            request, n, start = chunk.request, chunk.num_tokens, chunk.start
            row = len(positions)  # a draft model's pass takes its token from input_tokens
            tokens.extend(chunk.token_ids())
            positions.extend(range(start, start + n))
            if n == 1 and row >= len(decode):
                raise ValueError("single-token chunks must come first")
            if n == 1:
                decode_lens[row] = start + 1
            for g in groups:
                slots[g] += chunk.slots[g]
                seq = request.tables[g]
                if n == 1:
                    decode_tables[g, row, seq.live_from : len(seq.table)] = seq.table[seq.live_from :]
                else:
                    prefills[g].append(self._prefill_chunk(chunk, row, g))
        positions, lens = mx.array(positions, dtype=mx.int32), mx.array(decode_lens)
        pacer = LayerPacer() if paces_layers() else None  # one for the step: its layers in order, whatever group
        plans = [
            AttentionPlan(
                self.block_size, positions, mx.array(slots[g], dtype=mx.int32), len(decode),
                mx.array(decode_tables[g]), lens, prefills[g], one_token_per_sequence=not prefills[g], pacer=pacer,
            )
            for g in groups
        ]  # fmt: skip
        inputs = mx.array(tokens) if input_tokens is None else input_tokens
        return self._body(inputs[:, None], plans)
