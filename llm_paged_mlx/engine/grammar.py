"""Structured output: a request's JSON schema as a grammar of the tokens it may generate (llguidance).

Each constrained request has a matcher that follows its tokens; before a step
samples, every constrained row's allowed tokens become a bit mask over its row
of the logits (``bitmask``, then ``allowed``), so constrained and free
requests share steps.
llguidance was chosen by measurement (benchmarks/RESULTS.md): its masks for 64
requests take under a millisecond a step at a 150K vocabulary, and a schema
compiles in about one (once: compiled schemas are kept, and copied).

An object whose schema names all its properties takes only those unless the
schema says ``additionalProperties`` (as OpenAI's strict mode has it; see
``closed``): otherwise a model may add properties without end; the output
still fits the schema given.
"""

import json
import os
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Optional

import llguidance
import llguidance.hf
import llguidance.numpy
import mlx.core as mx
import numpy as np


# Between two JSON tokens, up to this much whitespace: room for indented JSON, and an end to a model that would
# write nothing else.
LAYOUT = {"whitespace_flexible": True, "whitespace_pattern": r"[\x20\x0A\x0D\x09]{0,32}"}

# llguidance's threads for one step's masks: past eight they cost more than they give (benchmarks/RESULTS.md).
MASK_THREADS = min(8, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)

# Schemas kept compiled (a compiled schema is small): a server's clients tend to send the same few.
COMPILED_SCHEMAS = 256


class JsonSchemaError(ValueError):
    """A JSON schema that cannot be a grammar; the message says why."""


class Grammars:
    """Matchers for one tokenizer's requests (the tokenizer's tables are made at first use: seconds for
    a large vocabulary)."""

    def __init__(self, tokenizer):
        """``tokenizer``: mlx-lm's ``TokenizerWrapper`` (or a Hugging Face fast tokenizer)."""
        self._hf = getattr(tokenizer, "_tokenizer", tokenizer)
        self._tokenizer: Optional[llguidance.LLTokenizer] = None
        self._compiled: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()  # schema's JSON: matcher at its start
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="llm-paged-mlx-masks")
        self._executor: Optional[llguidance.LLExecutor] = None

    def matcher(self, schema: dict) -> llguidance.LLMatcher:
        """A matcher at the start of ``schema``; ``JsonSchemaError`` if it is not one llguidance takes. The
        last ``COMPILED_SCHEMAS`` schemas are kept compiled: a request with one of them gets a copy."""
        try:
            key = json.dumps(schema)  # the order of properties is the order the output takes
        except (ValueError, TypeError) as e:
            raise JsonSchemaError(f"invalid JSON schema: {e}") from None
        start = self._compiled.pop(key, None) or self._compile(schema)
        self._compiled[key] = start
        while len(self._compiled) > COMPILED_SCHEMAS:
            self._compiled.popitem(last=False)
        return start.deep_copy()

    def _compile(self, schema: dict) -> llguidance.LLMatcher:
        if self._tokenizer is None:
            try:
                self._tokenizer = llguidance.hf.from_tokenizer(self._hf)
            except Exception as e:  # what llguidance cannot read of a tokenizer: its decoder, its vocabulary, ...
                raise ValueError(f"this model's tokenizer cannot constrain output to a JSON schema ({e})") from None
            self._executor = llguidance.LLExecutor(num_threads=MASK_THREADS)
        try:
            grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(closed(schema)), defaults=LAYOUT)
        except (ValueError, TypeError) as e:
            raise JsonSchemaError(f"invalid JSON schema: {e}") from None
        matcher = llguidance.LLMatcher(self._tokenizer, grammar)
        if not matcher.is_error():  # some dead ends (a $ref cycle) show only when the first mask is made
            llguidance.numpy.fill_next_token_bitmask(matcher, llguidance.numpy.allocate_token_bitmask(1, self.size))
        if matcher.is_error():
            raise JsonSchemaError(f"invalid JSON schema: {matcher.get_error()}")
        return matcher

    @property
    def size(self) -> int:
        """The tokenizer's vocabulary, as llguidance counts it."""
        return self._tokenizer.vocab_size

    def bitmask(self, matchers: list[Optional[llguidance.LLMatcher]]) -> np.ndarray:
        """The tokens each row may take next, as bits (``(len(matchers), words)`` int32): a row without a
        matcher has every bit set. Host work only, which llguidance does without the GIL: another thread
        may make it while this one launches a step."""
        mask = np.full((len(matchers), -(-self.size // 32)), -1, dtype=np.int32)
        rows = [(matcher, row) for row, matcher in enumerate(matchers) if matcher is not None]
        if rows:
            llguidance.numpy.fill_next_token_bitmask_par(self._executor, rows, mask)  # one call: the GIL goes once
        return mask

    def bitmask_meanwhile(self, matchers: list[Optional[llguidance.LLMatcher]]) -> Future:
        """``bitmask(matchers)`` made on this object's own thread."""
        return self._worker.submit(self.bitmask, matchers)

    @staticmethod
    def allowed(bitmask: np.ndarray, matchers: list[Optional[llguidance.LLMatcher]], vocab_size: int) -> mx.array:
        """``bitmask(matchers)`` as ``(rows, vocab_size)`` booleans (lazy); past the tokenizer's vocabulary,
        only the rows without a matcher allow any token."""
        words = bitmask.shape[1]
        wanted = -(-vocab_size // 32)
        if wanted > words:
            free = np.array([[matcher is None] for matcher in matchers])
            bitmask = np.concatenate([bitmask, np.where(free, -1, 0).astype(np.int32).repeat(wanted - words, 1)], 1)
        return _unpack(mx.array(bitmask))[:, :vocab_size]


@mx.compile  # one graph, not five operations to dispatch, in every constrained step
def _unpack(words: mx.array) -> mx.array:
    bits = (words.view(mx.uint32)[:, :, None] >> mx.arange(32, dtype=mx.uint32)) & 1
    return bits.reshape(words.shape[0], -1).astype(mx.bool_)


# Keywords whose value is a schema, a list of schemas, or a dict of schemas.
_SUBSCHEMA = ("items", "additionalItems", "contains", "not", "if", "then", "else", "propertyNames")
_SUBSCHEMA_LISTS = ("prefixItems", "anyOf", "oneOf", "allOf", "items")
_SUBSCHEMA_DICTS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_COMPOSITIONS = ("allOf", "anyOf", "oneOf")


def closed(schema, composed: bool = False):
    """``schema`` with ``additionalProperties: false`` in every object schema that names all its properties
    and does not say otherwise: not ``{"type": "object"}`` alone (any object), not one that requires a
    property it does not name, and not one that is combined with others (``allOf``/``anyOf``/``oneOf``
    branches, and objects that have them or a ``$ref``), whose properties may be named elsewhere."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SUBSCHEMA:
        if isinstance(out.get(key), dict):
            out[key] = closed(out[key])
    for key in _SUBSCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [closed(s, composed=key in _COMPOSITIONS) for s in out[key]]
    for key in _SUBSCHEMA_DICTS:
        if isinstance(out.get(key), dict):
            out[key] = {name: closed(s) for name, s in out[key].items()}
    if isinstance(out.get("additionalProperties"), dict):
        out["additionalProperties"] = closed(out["additionalProperties"])
    names = out.get("properties")
    if (
        isinstance(names, dict)
        and not composed
        and not any(key in out for key in ("additionalProperties", "patternProperties", "$ref", *_COMPOSITIONS))
        and set(out.get("required", [])) <= set(names)
    ):
        out["additionalProperties"] = False
    return out
