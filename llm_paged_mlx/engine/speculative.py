"""Speculative decoding: guess a request's next tokens, verify them in one step, keep what holds.

``Speculator.propose`` gives decoding requests their drafts. ``"ngram"`` (prompt
lookup, as in vLLM and Hugging Face): the tokens that followed an earlier
occurrence of the request's last n-gram (n from ``MAX_NGRAM`` down to
``MIN_NGRAM``) in the last ``LOOKUP_TOKENS`` of its prompt and output; a request
with a JSON schema drafts what its grammar takes, and each drafted position is
masked by the grammar as it stands after the tokens before it. ``"draft"``: only
a length, which a draft model fills within the step (``engine.drafter``; not for
requests with a schema). The scheduler runs the request's pending token and its
draft as one chunk with what budget and blocks are left, and the step samples a
token at every one of those positions, each exactly as a step without the draft
would sample it (same filters, same seeded key). ``accepted`` keeps the draft
while the sampled token equals the drafted one, and then the first sampled token
that differs (or the one after a whole accepted draft).

That is exact for any temperature: a draft is one token per position (a point
mass; the draft model's is greedy), so rejection sampling accepts it with the
target's probability of it, and on rejection samples from the target's
distribution without it, which is what drawing from the target and comparing
does. Greedy and seeded requests get the
same tokens as without speculation (up to how a device rounds a product of more
rows).

Adaptive: each request's draft length follows its acceptance, and ``MAX_MISSES``
chances in a row that gave nothing (no draft found, no room for it, or nothing
of it accepted) stop its drafts for its next ``PAUSE_TOKENS`` tokens, twice as
many after each pause that nothing was accepted since (up to ``MAX_PAUSE_TOKENS``),
when run-ahead takes over again; no step drafts when more than ``max_batch``
requests run, where the rows a draft adds cost more than the tokens it saves.
"""

from dataclasses import dataclass, field

import numpy as np

MIN_NGRAM, MAX_NGRAM = 1, 3
LOOKUP_TOKENS = 8192
MAX_MISSES = 4
PAUSE_TOKENS = 16
MAX_PAUSE_TOKENS = 512


def lookup(tokens: np.ndarray, k: int) -> list[int]:
    """Up to ``k`` tokens that followed an earlier occurrence of the sequence's last n-gram (the longest n
    that recurs): the latest occurrence with ``k`` tokens after it, else the earliest; none if none recurs."""
    tokens = tokens[-LOOKUP_TOKENS:]
    for n in range(min(MAX_NGRAM, len(tokens) - 1), MIN_NGRAM - 1, -1):
        windows = np.lib.stride_tricks.sliding_window_view(tokens[:-1], n)
        starts = np.flatnonzero((windows == tokens[-n:]).all(axis=1))
        if len(starts):
            whole = starts[starts + n + k <= len(tokens)]
            follow = (whole[-1] if len(whole) else starts[0]) + n
            return tokens[follow : follow + k].tolist()
    return []


def accepted(draft: list[int], sampled: list[int]) -> list[int]:
    """The tokens a request gets from a verified draft: ``sampled[i]`` is the token sampled after the pending
    token and ``draft[:i]``; the draft holds while it agrees, and the first disagreeing sample ends it."""
    for i, token in enumerate(draft):
        if sampled[i] != token:
            return sampled[: i + 1]
    return sampled[: len(draft) + 1]


@dataclass
class DraftCounts:
    """Drafts verified, the tokens they held and those accepted: a request's, or an engine's."""

    drafts: int = 0
    tokens: int = 0
    accepted: int = 0

    def add(self, drafted: int, accepted: int) -> None:
        self.drafts += 1
        self.tokens += drafted
        self.accepted += accepted

    def as_dict(self) -> dict:
        return {
            "drafts": self.drafts,
            "draft_tokens": self.tokens,
            "accepted_draft_tokens": self.accepted,
            "draft_acceptance_rate": self.accepted / self.tokens if self.tokens else None,
            # what a step that verified a draft gave its request: the accepted tokens and the one after them
            "tokens_per_draft_step": (self.accepted + self.drafts) / self.drafts if self.drafts else None,
        }


@dataclass
class _Pace:
    """A request's draft length, its recent luck, and its tokens as an array (grown as they come)."""

    length: int
    misses: int = 0  # chances in a row that gave nothing
    paused_until: int = 0  # drafts again once it has generated this many tokens
    pause: int = PAUSE_TOKENS  # the next pause's tokens
    tokens: np.ndarray = field(default_factory=lambda: np.zeros(256, dtype=np.int64))
    known: int = 0  # of its tokens, those in ``tokens``


class Speculator:
    """Drafts for an engine's decoding requests (``mode``: by prompt lookup, or lengths a draft model fills),
    at most ``num_tokens`` a step each, and the counts ``stats()`` reports."""

    def __init__(self, mode: str, num_tokens: int, max_batch: int):
        self.mode, self.num_tokens, self.max_batch = mode, num_tokens, max_batch
        self.paces: dict[int, _Pace] = {}
        self.counts = DraftCounts()

    def active(self, running: list) -> bool:
        """Whether the next step may draft for some of ``running`` (the scheduler's running requests)."""
        return len(running) <= self.max_batch and any(self._may_draft(r) for r in running)

    def propose(self, running: list) -> dict[int, list[int]]:
        """Drafts for the running requests that decode next (by request id); none when too many run."""
        if len(running) > self.max_batch:
            return {}
        drafts = {}
        for request in running:
            if request.num_pending != 1 or not self._may_draft(request):
                continue  # a prompt chunk runs
            room = min(
                request.params.max_tokens - len(request.output_token_ids) - 1,
                request.max_total_tokens - request.num_tokens - 1,
            )
            k = min(self._pace(request).length, room)
            if self.mode == "draft":  # its length only: the draft model makes it within the step
                if k >= 1:
                    drafts[request.request_id] = [0] * k
                continue
            draft = lookup(self._tokens(request), k) if k >= 1 else []
            if draft and request.grammar is not None:  # as far as its grammar takes the tokens
                draft = draft[: request.grammar.validate_tokens(draft)]
            if draft:
                drafts[request.request_id] = draft
            elif k >= 1:
                self.missed(request)
        return drafts

    def record(self, request, drafted: int, accepted: int) -> None:
        """What a step made of a request's draft of ``drafted`` tokens: its next draft length follows."""
        pace = self._pace(request)
        self.counts.add(drafted, accepted)
        request.drafted.add(drafted, accepted)
        if accepted:
            pace.length = min(self.num_tokens, pace.length + 1) if accepted == drafted else accepted + 1
            pace.misses, pace.pause = 0, PAUSE_TOKENS
        else:
            pace.length = 1
            self.missed(request)

    def missed(self, request) -> None:
        """A chance to draft that gave nothing (its draft was found wanting, or no room, or nothing found)."""
        pace = self._pace(request)
        pace.misses += 1
        if pace.misses >= MAX_MISSES:
            pace.misses, pace.paused_until = 0, len(request.output_token_ids) + pace.pause
            pace.pause = min(MAX_PAUSE_TOKENS, 2 * pace.pause)

    def unscheduled(self, drafts: dict[int, list[int]], chunks: list) -> None:
        """Count a miss for each request whose draft the step (its ``chunks``) had no room for."""
        for chunk in chunks:
            if chunk.request.request_id in drafts and not chunk.draft:
                self.missed(chunk.request)

    def forget(self, request_id: int) -> None:
        self.paces.pop(request_id, None)

    def stats(self) -> dict:
        return {"speculative": self.mode, "num_speculative_tokens": self.num_tokens, **self.counts.as_dict()}

    def _tokens(self, request) -> np.ndarray:
        """The request's tokens as an array, extended by those it gained since the last call."""
        pace, count = self._pace(request), request.num_tokens
        if count > len(pace.tokens):
            pace.tokens = np.concatenate([pace.tokens[: pace.known], np.zeros(count, dtype=np.int64)])
        pace.tokens[pace.known : count] = request.token_slice(pace.known, count)
        pace.known = count
        return pace.tokens[:count]

    def _may_draft(self, request) -> bool:
        """Not paused, nor constrained with a draft model (its grammar would mask drafted positions on the
        host, and the draft model's stay on the device)."""
        paused = self._pace(request).paused_until > len(request.output_token_ids)
        return not paused and not (self.mode == "draft" and request.grammar is not None)

    def _pace(self, request) -> _Pace:
        pace = self.paces.get(request.request_id)
        if pace is None:
            pace = self.paces[request.request_id] = _Pace(self.num_tokens)
        return pace
