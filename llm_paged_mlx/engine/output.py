"""What the engine hands back: stream chunks, finished outputs, the text of each request, and the rules by which
a request stops."""

from dataclasses import dataclass, field
from typing import Optional

from .speculative import DraftCounts


@dataclass
class TokenLogprob:
    """A generated token's log-probability, and the most likely tokens' at its position (best first)."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass
class StreamChunk:
    """What one step added to a request: new token ids and new text."""

    request_id: int
    token_ids: list[int]
    text: Optional[str]
    finish_reason: Optional[str] = None  # "stop" | "length" | "abort" once finished
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache (set when finished)
    num_disk_cached_tokens: int = 0  # of those, the ones read from the disk tier
    logprobs: Optional[list[TokenLogprob]] = None  # one per token id, if the request asked for them
    drafted: Optional[DraftCounts] = None  # what speculative decoding drafted for it (set when finished)


@dataclass
class RequestOutput:
    request_id: int
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: Optional[str] = None
    finish_reason: Optional[str] = None
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    num_disk_cached_tokens: int = 0  # of those, the ones read from the disk tier
    logprobs: Optional[list[TokenLogprob]] = None  # one per token id, if the request asked for them
    drafted: Optional[DraftCounts] = None  # what speculative decoding drafted for it

    def add(self, chunk: StreamChunk) -> None:
        """Take in the request's next chunk."""
        self.token_ids += chunk.token_ids
        if chunk.logprobs is not None:
            self.logprobs = (self.logprobs or []) + chunk.logprobs
        if chunk.text is not None:
            self.text += chunk.text
        self.finish_reason = chunk.finish_reason
        self.num_cached_tokens = chunk.num_cached_tokens
        self.num_disk_cached_tokens = chunk.num_disk_cached_tokens
        self.drafted = chunk.drafted


def joined(earlier: list[StreamChunk], last: StreamChunk) -> StreamChunk:
    """``last`` with the tokens, text and log-probabilities of the ``earlier`` chunks of its request before
    its own."""
    for chunk in reversed(earlier):
        last.token_ids = chunk.token_ids + last.token_ids
        if chunk.logprobs is not None:
            last.logprobs = chunk.logprobs + (last.logprobs or [])
        if chunk.text is not None:
            last.text = chunk.text + last.text
    return last


class OutputText:
    """A request's text, detokenized as tokens arrive, cut at the first stop string.

    Text that could still turn into a stop string is held back from ``take``.
    """

    def __init__(self, tokenizer, stop: Optional[list[str]], after: Optional[int] = None):
        """``after``: a token the text follows (the prompt's last), detokenized first for context and left out
        of the text, so that the text's first word keeps its leading space."""
        self.detokenizer = tokenizer.detokenizer
        self.stop = stop or []
        self.holdback = max((len(s) for s in self.stop), default=1) - 1
        self.text = ""
        self.taken = 0
        self.stopped = False
        self.hidden = 0  # characters still to come that are the context's, not the text's
        if after is not None:
            self.detokenizer.add_token(after)
            alone = tokenizer.detokenizer  # the context's whole text, some of which a detokenizer holds back
            alone.add_token(after)
            alone.finalize()
            self.hidden = len(alone.text) - len(self.detokenizer.last_segment)

    def add(self, token: int) -> bool:
        """Add a token; True if the text now reaches a stop string (the text is cut there)."""
        self.detokenizer.add_token(token)
        return self._extend(self.detokenizer.last_segment)

    def finish(self) -> None:
        if self.stopped:
            return
        self.detokenizer.finalize()
        self._extend(self.detokenizer.last_segment)

    def take(self, final: bool) -> str:
        """The text not returned before (all of it when ``final``)."""
        end = len(self.text) if final else max(self.taken, len(self.text) - self.holdback)
        new, self.taken = self.text[self.taken : end], end
        return new

    def _extend(self, segment: str) -> bool:
        cut = min(self.hidden, len(segment))
        segment, self.hidden = segment[cut:], self.hidden - cut
        start = max(0, len(self.text) - self.holdback)
        self.text += segment
        hits = [i for i in (self.text.find(s, start) for s in self.stop) if i >= 0]
        if hits:
            self.text = self.text[: min(hits)]
            self.stopped = True
        return bool(hits)


def take_token(request, token: int, text: Optional[OutputText]) -> tuple[Optional[str], list[int]]:
    """Give ``request`` (an ``engine.request.Request``) its sampled ``token``, its ``text`` and grammar
    following it, by the stop rules: why it ends with this token, if it does ("stop": one of its stop tokens,
    which is not kept, a stop string, or a whole JSON value; "length": ``max_tokens`` or the context), and
    the tokens it gains."""
    if token in request.stop_token_ids:
        return "stop", []
    request.output_token_ids.append(token)
    if text is not None and text.add(token):
        return "stop", [token]
    if request.grammar is not None:
        request.grammar.consume_token(token)
        if request.grammar.is_stopped():  # the JSON is whole and nothing may follow it
            return "stop", [token]
    if len(request.output_token_ids) >= request.params.max_tokens or request.num_tokens >= request.max_total_tokens:
        return "length", [token]
    return None, [token]
