"""A request's answer in OpenAI's form: whole, or streamed as server-sent events."""

import asyncio
import contextlib
import json
import time
import uuid
from dataclasses import dataclass, field
from typing import AsyncIterator, Optional

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from ..engine.output import StreamChunk, TokenLogprob
from ..tool_calls import ToolCallReader
from .errors import APIError, request_error, server_error
from .metrics import ServerMetrics
from .schemas import SamplingFields


async def respond(run: "Run", body: SamplingFields, request: Request, kind: str, prefix: str, tools=()):
    """The answer to a started request: a stream if it asked for one, else the whole response."""
    submission = run.submission
    calls = ToolCallReader(submission.tokenizer, tools) if tools else None
    shape = Shape(kind, f"{prefix}-{uuid.uuid4().hex}", body.model, created=int(time.time()),
                  tokenizer=submission.tokenizer, logprobs=submission.params.logprobs is not None, calls=calls)
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return StreamingResponse(stream(run, shape, include_usage), media_type="text/event-stream")
    async with cancelled_on_disconnect(request, submission):
        chunks = [chunk async for chunk in run.rest()]
    if chunks[-1].finish_reason == "abort":  # the client has gone: nobody reads an answer
        return Response(status_code=499)
    return shape.whole(chunks, run.usage())


async def stream(run: "Run", shape: "Shape", include_usage: bool) -> AsyncIterator[str]:
    try:
        yield event(shape.chunk(None, first=True, usage=include_usage))
        async for chunk in run.rest():
            yield shape.event(chunk, usage=include_usage)
        if include_usage:
            yield event(shape.usage_chunk(run.usage()))
        yield "data: [DONE]\n\n"
    except APIError as e:
        yield event(e.body())


@contextlib.asynccontextmanager
async def cancelled_on_disconnect(request: Request, submission):
    """Cancel ``submission`` if the client disconnects while the block runs."""

    async def watch():
        while (await request.receive())["type"] != "http.disconnect":
            pass
        submission.cancel()

    watcher = asyncio.create_task(watch())
    try:
        yield
    finally:
        watcher.cancel()


class Run:
    """A submitted request's chunks as the server reads them, with their timings for the metrics."""

    def __init__(self, submission, metrics: ServerMetrics):
        self.submission = submission
        self.metrics = metrics
        self.chunks = submission.__aiter__()
        self.pending: list[StreamChunk] = []
        self.generated = 0
        self.final: Optional[StreamChunk] = None
        self.last = None

    async def first(self) -> None:
        """Wait for the first chunk; a request error (a prompt that does not fit) is raised as a 400."""
        try:
            self.pending.append(await self._next())
        except Exception as e:
            raise request_error(e) from None

    async def rest(self) -> AsyncIterator[StreamChunk]:
        try:
            while self.pending or self.final is None:
                chunk = self.pending.pop(0) if self.pending else await self._next()
                yield chunk
        except Exception as e:  # mid-stream: the stream ends with this error event
            raise server_error(e) from None
        finally:
            await self.chunks.aclose()  # a request left unfinished is cancelled

    async def _next(self) -> StreamChunk:
        chunk = await self.chunks.__anext__()
        now = time.monotonic()
        if chunk.token_ids:
            if self.generated == 0:
                self.metrics.first_token(now - self.submission.submitted)
            else:
                self.metrics.next_token(now - self.last, len(chunk.token_ids))
            self.last = now
        self.generated += len(chunk.token_ids)
        if chunk.finish_reason:
            self.final = chunk
            self.metrics.finished(now - self.submission.submitted, self.prompt_tokens, self.generated,
                                  chunk.finish_reason)
        return chunk

    @property
    def prompt_tokens(self) -> int:
        return self.submission.prompt_tokens or 0  # None: cancelled before the engine took (and tokenized) it

    def usage(self) -> dict:
        prompt = self.prompt_tokens
        cached = self.final.num_cached_tokens if self.final else 0
        return {"prompt_tokens": prompt, "completion_tokens": self.generated, "total_tokens": prompt + self.generated,
                "prompt_tokens_details": {"cached_tokens": cached}}


@dataclass
class Shape:
    """OpenAI's response objects for one request: whole, or as stream chunks."""

    kind: str  # "chat.completion" or "text_completion"
    ident: str
    model: str
    created: int
    tokenizer: object  # None: tokens are shown as their ids
    logprobs: bool  # the request asked for them
    calls: Optional[ToolCallReader] = None  # reads tool calls out of the text, when the request gave tools
    text_offset: int = 0  # a completion's text so far, in characters, as the logprobs count them
    _template: Optional[tuple[str, str]] = field(default=None, repr=False)  # see event()
    _calls_sent: int = 0  # tool calls streamed so far

    @property
    def chat(self) -> bool:
        return self.kind == "chat.completion"

    def whole(self, chunks: list[StreamChunk], usage: dict) -> dict:
        text = self._visible("".join(c.text or "" for c in chunks), final=True)
        calls = [{k: v for k, v in call.items() if k != "index"} for call in self._new_calls()]
        logprobs = [lp for c in chunks for lp in c.logprobs or []]
        reason = self._reason(chunks[-1].finish_reason)
        choice = {"index": 0, "finish_reason": reason, "logprobs": self._logprobs(logprobs)}
        if self.chat:
            message = {"role": "assistant", "content": text}
            if calls:
                message.update(content=text or None, tool_calls=calls)
            choice["message"] = message
        else:
            choice["text"] = text
        return {"id": self.ident, "object": self.kind, "created": self.created, "model": self.model,
                "choices": [choice], "usage": usage}

    def chunk(self, chunk: Optional[StreamChunk], first: bool = False, usage: bool = False, text=None,
              tool_calls=None) -> dict:  # fmt: skip
        """A stream chunk: the first (the role), or one of ``chunk``'s text (``text`` instead, if given) and
        ``tool_calls`` (with their index in the stream)."""
        if first:
            delta = {"role": "assistant", "content": ""}
            reason, logprobs = None, None
        else:
            delta = {"content": chunk.text or "" if text is None else text}
            if tool_calls:
                delta["tool_calls"] = tool_calls
            reason, logprobs = self._reason(chunk.finish_reason), self._logprobs(chunk.logprobs or [])
        choice = {"index": 0, "finish_reason": reason, "logprobs": logprobs}
        choice.update({"delta": delta} if self.chat else {"text": delta["content"]})
        body = {"id": self.ident, "object": self._chunk_kind, "created": self.created, "model": self.model,
                "choices": [choice]}
        if usage:
            body["usage"] = None
        return body

    def event(self, chunk: StreamChunk, usage: bool) -> str:
        """``chunk`` as a stream event (``usage``: the same for every chunk of a stream). Most events carry text
        alone: a template (made once, by ``chunk``) around the text's JSON, which costs the server's thread a
        fraction of encoding the whole chunk for each token."""
        text = self._visible(chunk.text or "", final=chunk.finish_reason is not None)
        calls = self._new_calls()
        if self.logprobs or chunk.finish_reason or calls:
            return event(self.chunk(chunk, usage=usage, text=text, tool_calls=calls))
        if self._template is None:  # the text is the last string in the chunk: what follows it holds no string
            head, _, tail = event(self.chunk(StreamChunk(0, [], _MARK), usage=usage)).rpartition(json.dumps(_MARK))
            self._template = head, tail
        head, tail = self._template
        return head + json.dumps(text) + tail

    def _visible(self, text: str, final: bool) -> str:
        """What the user sees of generated ``text`` (``final``: the request's last): tool calls taken out."""
        if self.calls is None:
            return text
        text = self.calls.feed(text)
        return text + self.calls.finish() if final else text

    def _new_calls(self) -> list[dict]:
        """The tool calls read since the last time, in OpenAI's form (streamed: with their index)."""
        new = self.calls.calls[self._calls_sent :] if self.calls else []
        out = []
        for index, call in enumerate(new, start=self._calls_sent):
            out.append({"index": index, "id": call.id or f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                        "function": {"name": call.name, "arguments": json.dumps(call.arguments)}})
        self._calls_sent += len(new)
        return out

    def _reason(self, finish_reason: Optional[str]) -> Optional[str]:
        """OpenAI's finish reason: "tool_calls" for an answer that called tools and ended by itself."""
        return "tool_calls" if finish_reason == "stop" and self._calls_sent else finish_reason

    def usage_chunk(self, usage: dict) -> dict:
        return {"id": self.ident, "object": self._chunk_kind, "created": self.created, "model": self.model,
                "choices": [], "usage": usage}

    @property
    def _chunk_kind(self) -> str:
        return "chat.completion.chunk" if self.chat else "text_completion"

    def _logprobs(self, logprobs: list[TokenLogprob]):
        if not self.logprobs:
            return None
        if self.chat:
            return {"content": [self._chat_entry(lp) for lp in logprobs]}
        tokens = [self._text(lp.token_id) for lp in logprobs]
        offsets = []
        for token in tokens:
            offsets.append(self.text_offset)
            self.text_offset += len(token)
        return {"tokens": tokens, "token_logprobs": [lp.logprob for lp in logprobs],
                "top_logprobs": [{self._text(t): v for t, v in lp.top} for lp in logprobs], "text_offset": offsets}

    def _chat_entry(self, lp: TokenLogprob) -> dict:
        entry = self._token(lp.token_id, lp.logprob)
        entry["top_logprobs"] = [self._token(t, v) for t, v in lp.top]
        return entry

    def _token(self, token_id: int, logprob: float) -> dict:
        text = self._text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    def _text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id]) if self.tokenizer is not None else str(token_id)


_MARK = "\x00"  # where a template's text goes


def event(body: dict) -> str:
    return f"data: {json.dumps(body)}\n\n"
