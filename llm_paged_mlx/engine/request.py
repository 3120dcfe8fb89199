"""A request: its sampling parameters, its tokens and where it stands."""

import enum
import itertools
import math
import numbers
import time
from dataclasses import dataclass, field
from typing import Optional

from .block_manager import SequenceBlocks
from .speculative import DraftCounts

_arrivals = itertools.count()
MAX_LOGPROBS = 20  # as OpenAI's top_logprobs
MAX_LOGIT_BIAS = 100  # as OpenAI's logit_bias: from -100 (never) to 100 (only)


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one request. Temperature 0 is greedy; a smaller ``priority`` is served first.

    ``logprobs``: report each generated token's log-probability and those of the
    ``logprobs`` most likely tokens (0 to ``MAX_LOGPROBS``; None: none).
    ``continues_prompt``: detokenize the text as the prompt's continuation, so that it
    keeps a leading space that a reply's text drops (OpenAI's completions).
    ``json_schema``: the output is JSON that fits this schema (a dict; ``{"type": "object"}``
    for any object): only tokens that keep it so are sampled (``engine.grammar``).
    ``logit_bias``: token id -> a bias from -``MAX_LOGIT_BIAS`` to ``MAX_LOGIT_BIAS`` added to
    that token's logit before sampling (an id past the model's logits has none to bias).
    """

    max_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: Optional[int] = None
    stop: Optional[list[str]] = None
    stop_token_ids: Optional[list[int]] = None
    ignore_eos: bool = False
    priority: int = 0
    logprobs: Optional[int] = None
    continues_prompt: bool = False
    json_schema: Optional[dict] = None
    logit_bias: Optional[dict[int, float]] = None

    def __post_init__(self):
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", [self.stop])
        if not isinstance(self.max_tokens, int) or self.max_tokens <= 0:
            raise ValueError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if not (_finite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not (_finite(self.top_p) and 0 < self.top_p <= 1):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not (_integer(self.top_k) and self.top_k >= 0):
            raise ValueError(f"top_k must be an integer >= 0, got {self.top_k!r}")
        if not (_finite(self.min_p) and 0 <= self.min_p <= 1):
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        if self.seed is not None and not _integer(self.seed):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        if self.stop and any(not s for s in self.stop):
            raise ValueError("stop strings must not be empty")
        if self.json_schema is not None and not isinstance(self.json_schema, dict):
            raise ValueError(f"json_schema must be a JSON schema as a dict, got {type(self.json_schema).__name__}")
        if self.logprobs is not None and not (isinstance(self.logprobs, int) and 0 <= self.logprobs <= MAX_LOGPROBS):
            raise ValueError(f"logprobs must be an integer from 0 to {MAX_LOGPROBS}, got {self.logprobs!r}")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                kind = type(self.logit_bias).__name__
                raise ValueError(f"logit_bias must be a dict of token ids to biases, got {kind}")
            for token, bias in self.logit_bias.items():
                if not (_integer(token) and token >= 0):
                    raise ValueError(f"logit_bias: {token!r} is not a token id (an integer >= 0)")
                if not (_finite(bias) and -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS):
                    raise ValueError(f"logit_bias: the bias of token {token} must be from -{MAX_LOGIT_BIAS} to "
                                     f"{MAX_LOGIT_BIAS}, got {bias!r}")


def _integer(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _finite(value) -> bool:
    """Whether ``value`` is a real number other than inf and nan (a bool is none)."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Request:
    """One prompt being served.

    ``num_computed`` tokens have their K/V in the blocks of its ``tables``
    (written, or being written by a launched step): the one count the engine
    keeps of it. There is a table per group of attention layers
    (``engine.kv_groups``); most models have one.
    """

    request_id: int
    prompt_token_ids: list[int]
    params: SamplingParams
    max_total_tokens: int  # the context limit: prompt + output never exceed it
    arrival: int = field(default_factory=lambda: next(_arrivals))
    arrival_time: float = field(default_factory=time.monotonic)
    output_token_ids: list[int] = field(default_factory=list)
    num_computed: int = 0
    tables: list[SequenceBlocks] = field(default_factory=lambda: [SequenceBlocks()])
    status: Status = Status.WAITING
    finish_reason: Optional[str] = None
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache at admission
    num_disk_cached_tokens: int = 0  # of those, the ones read from the disk tier
    drafted: DraftCounts = field(default_factory=DraftCounts)  # what speculative decoding drafted for it
    draft_start: int = 0  # a draft model's K/V may be missing from this position on (engine.drafter)
    swap_handle: object = None  # what a swap policy kept of a preempted request's K/V
    saved_state: Optional[list] = None  # with a swap handle: host copies of its recurrent state, if it has one
    num_preemptions: int = 0
    num_bypassed: int = 0  # later-ranked requests admitted while this one waited for blocks
    stop_token_ids: frozenset = frozenset()  # EOS (unless ignored) and SamplingParams.stop_token_ids
    grammar: object = None  # with params.json_schema: the matcher of the tokens it may take next (engine.grammar)

    @property
    def blocks(self) -> SequenceBlocks:
        """The first group's table: the only one of most models."""
        return self.tables[0]

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_slice(self, start: int, stop: int) -> list[int]:
        """``token_ids[start:stop]`` without building the whole list."""
        split = len(self.prompt_token_ids)
        if stop <= split:
            return self.prompt_token_ids[start:stop]
        if start >= split:
            return self.output_token_ids[start - split : stop - split]
        return self.prompt_token_ids[start:] + self.output_token_ids[: stop - split]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_pending(self) -> int:
        """Tokens whose K/V still has to be computed."""
        return self.num_tokens - self.num_computed

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED
