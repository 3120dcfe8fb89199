"""The OpenAI-compatible HTTP API over one model's engine loop (FastAPI).

Every request becomes a submission to the loop, so concurrent clients share the
engine's steps. A client that disconnects cancels its request: its blocks are
free before the loop's next step. Bad input gets OpenAI's error body with a 4xx
status, never a 500.
"""

import asyncio
import contextlib
import functools
import hmac
import json
import time
import uuid
from dataclasses import dataclass, field
from typing import AsyncIterator, Optional

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from jinja2 import TemplateError
from starlette.exceptions import HTTPException

from ..chat import render_prompt
from ..engine.engine import encode_text
from ..engine.loop import EngineLoop, LoopStopped, QueueFull
from ..engine.output import StreamChunk, TokenLogprob
from ..engine.request import SamplingParams
from ..errors import one_line
from ..tool_calls import ToolCallReader
from .limits import BodySizeLimit
from .metrics import ServerMetrics
from .schemas import (
    ChatCompletion,
    ChatCompletionRequest,
    Completion,
    CompletionRequest,
    ErrorBody,
    ModelCard,
    ModelList,
    SamplingFields,
)

# The errors each API route may answer with, for the OpenAPI schema; streams are server-sent events, each of
# whose data is a chunk as JSON (the last: [DONE]).
_ERRORS = {status: {"model": ErrorBody} for status in (400, 401, 404, 413, 503)}
_EVENT = {"type": "object", "properties": {"data": {"type": "string"}}, "required": ["data"]}
_STREAM = {"content": {"text/event-stream": {"schema": _EVENT}}}


class APIError(Exception):
    """An error for the client, in OpenAI's error body."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param=None, code=None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if self.status == 401 else None
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


@dataclass
class ServedModel:
    """What the server serves: the model's names, its loop, the loop's config, and request defaults."""

    model_id: str
    loop: EngineLoop
    config: object = None
    aliases: tuple[str, ...] = ()
    defaults: dict = field(default_factory=dict)  # SamplingParams fields for requests that leave them out
    max_tokens_limit: int = 32768  # the most tokens a request may ask for


def create_app(served: ServedModel, api_key: Optional[str] = None, max_body_bytes: int = 32 * 1024**2) -> FastAPI:
    """The FastAPI app serving ``served``; ``api_key``, if given, is required as a bearer token on /v1."""
    app = FastAPI(title="llm-paged-mlx", summary="An OpenAI-compatible API over a paged-KV MLX engine")
    app.add_middleware(BodySizeLimit, limit=max_body_bytes, error=lambda message: APIError(413, message).response())
    metrics = ServerMetrics(served.loop, served.model_id)
    created = int(time.time())

    @app.exception_handler(APIError)
    async def api_error(request, error: APIError):
        return error.response()

    @app.exception_handler(RequestValidationError)
    async def invalid_body(request, error: RequestValidationError):
        return _invalid_body(request, error.errors()).response()

    @app.exception_handler(HTTPException)
    async def http_error(request, error: HTTPException):
        response = APIError(error.status_code, str(error.detail)).response()
        response.headers.update(error.headers or {})  # 405's Allow
        return response

    @app.exception_handler(Exception)
    async def internal_error(request, error: Exception):
        return APIError(500, f"internal error: {one_line(error)}", type="server_error").response()

    def authorized(request: Request) -> None:
        if api_key is None:
            return
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), api_key.encode()):
            raise APIError(401, "missing or wrong API key: send it as 'Authorization: Bearer <key>'", code="invalid_api_key")

    def check_model(name: str) -> None:
        if name != served.model_id and name not in served.aliases:
            raise APIError(404, f"the model {name!r} does not exist; this server serves {served.model_id!r}",
                           param="model", code="model_not_found")

    @app.get("/health", responses={503: {"description": "The engine loop has stopped"}})
    async def health():
        if served.loop.parked.is_set():
            return JSONResponse({"status": "stopped"}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics", response_class=PlainTextResponse, responses={200: {"description": "Prometheus text format"}})
    async def prometheus():
        return PlainTextResponse(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    def card(name: str) -> dict:
        return {"id": name, "object": "model", "created": created, "owned_by": "llm-paged-mlx"}

    @app.get("/v1/models", dependencies=[Depends(authorized)], response_model=ModelList, responses=_ERRORS)
    async def models():
        return {"object": "list", "data": [card(name) for name in (served.model_id, *served.aliases)]}

    @app.get("/v1/models/{model}", dependencies=[Depends(authorized)], response_model=ModelCard, responses=_ERRORS)
    async def model(model: str):
        check_model(model)
        return card(model)

    @app.post("/v1/chat/completions", dependencies=[Depends(authorized)], response_model=ChatCompletion,
              responses={**_ERRORS, 200: _STREAM})
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        check_model(body.model)
        messages = [_chat_message(m, i) for i, m in enumerate(body.messages)]
        if body.top_logprobs is not None and not body.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        tools = [t.model_dump(exclude_none=True) for t in body.tools or []] if body.tool_choice != "none" else []
        top = body.top_logprobs if body.top_logprobs is not None else 0
        params = sampling(body, body.max_completion_tokens or body.max_tokens, top if body.logprobs else None,
                          json_schema=body.json_schema())  # fmt: skip
        run = await start(lambda tokenizer: render_prompt(tokenizer, messages, tools), params, request)
        return await respond(run, body, request, "chat.completion", "chatcmpl", tools)

    @app.post("/v1/completions", dependencies=[Depends(authorized)], response_model=Completion,
              responses={**_ERRORS, 200: _STREAM})
    async def completions(body: CompletionRequest, request: Request):
        check_model(body.model)
        prompt = body.prompt[0] if isinstance(body.prompt, list) and isinstance(body.prompt[0], (str, list)) else body.prompt
        if isinstance(prompt, str):
            prompt = functools.partial(_document, text=_text(prompt, "prompt"))
        params = sampling(body, body.max_tokens, body.logprobs, continues_prompt=True)
        run = await start(prompt, params, request)
        return await respond(run, body, request, "text_completion", "cmpl")

    def sampling(body: SamplingFields, max_tokens: Optional[int], logprobs: Optional[int],
                 continues_prompt: bool = False, json_schema: Optional[dict] = None) -> SamplingParams:
        if max_tokens is not None and max_tokens > served.max_tokens_limit:
            raise APIError(400, f"max_tokens is {max_tokens}; this server allows at most {served.max_tokens_limit}",
                           param="max_tokens")
        bias = {int(token): value for token, value in body.logit_bias.items()} if body.logit_bias else None
        given = {"max_tokens": max_tokens, "temperature": body.temperature, "top_p": body.top_p, "seed": body.seed,
                 "stop": body.stops(), "logprobs": logprobs, "continues_prompt": continues_prompt,
                 "json_schema": json_schema, "logit_bias": bias}
        try:
            return SamplingParams(**{**served.defaults, **{k: v for k, v in given.items() if v is not None}})
        except ValueError as e:
            raise APIError(400, one_line(e)) from None

    async def start(prompt, params: SamplingParams, request: Request) -> "_Run":
        """Submit the request and wait for its first chunk, so that an error in the prompt is a 4xx response."""
        if params.logit_bias:
            prompt = _bias_checked(prompt, params.logit_bias)
        prompt = await tokenized(prompt)
        try:
            submission = served.loop.submit(prompt, params, served.config)
        except QueueFull as e:
            raise APIError(503, f"the server is busy: {e}; try again later", type="server_error") from None
        except LoopStopped as e:
            raise _server_error(e) from None
        run = _Run(submission, metrics)
        async with cancelled_on_disconnect(request, submission):
            await run.first()
        return run

    async def tokenized(prompt):
        """The prompt's token ids, made on a worker thread so that a long prompt or chat does not hold up the
        loop's thread (and every running request with it); before the engine is built, the loop makes them."""
        tokenizer = served.loop.tokenizer
        if tokenizer is None or isinstance(prompt, list):
            return prompt
        try:
            encode = prompt if callable(prompt) else lambda tokenizer: encode_text(tokenizer, prompt)  # chat or text
            return await asyncio.to_thread(encode, tokenizer)
        except Exception as e:
            raise _request_error(e) from None

    async def respond(run: "_Run", body: SamplingFields, request: Request, kind: str, prefix: str, tools=()):
        submission = run.submission
        calls = ToolCallReader(submission.tokenizer, tools) if tools else None
        shape = _Shape(kind, f"{prefix}-{uuid.uuid4().hex}", body.model, created=int(time.time()),
                       tokenizer=submission.tokenizer, logprobs=submission.params.logprobs is not None, calls=calls)
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return StreamingResponse(stream(run, shape, include_usage), media_type="text/event-stream")
        async with cancelled_on_disconnect(request, submission):
            chunks = [chunk async for chunk in run.rest()]
        if chunks[-1].finish_reason == "abort":  # the client has gone: nobody reads an answer
            return Response(status_code=499)
        return shape.whole(chunks, run.usage())

    async def stream(run: "_Run", shape: "_Shape", include_usage: bool) -> AsyncIterator[str]:
        try:
            yield _event(shape.chunk(None, first=True, usage=include_usage))
            async for chunk in run.rest():
                yield shape.event(chunk, usage=include_usage)
            if include_usage:
                yield _event(shape.usage_chunk(run.usage()))
            yield "data: [DONE]\n\n"
        except APIError as e:
            yield _event(e.body())

    return app


def _invalid_body(request: Request, errors: list[dict]) -> APIError:
    """The first of pydantic's errors as a 400 that names the field (not pydantic's names for union branches)."""
    first = errors[0]
    if first["type"] == "json_invalid":
        return APIError(400, f"the body is not valid JSON: {first['ctx']['error']} at character {first['loc'][-1]}")
    content_type = request.headers.get("content-type", "")
    if first["loc"] == ("body",) and not content_type.startswith("application/json"):
        return APIError(400, f"send the body as JSON with 'Content-Type: application/json' (not {content_type!r})")
    path = _field_path(first["loc"][1:])
    if not path:
        return APIError(400, "the body must be a JSON object")
    message = first["msg"]
    if first["loc"][-1] == "[key]":  # a mapping's key is wrong, not its value
        path, message = path[:-1], f"the key {path[-1]!r}: {message}"
    elif len(path) + 1 < len(first["loc"]):  # a union: report the branch that got furthest, else the forms
        union = [e for e in errors if e["loc"][1:len(path) + 1] == path]
        deepest = max(union, key=lambda e: len(e["loc"]))
        batch = first["input"]
        if path == ("prompt",) and isinstance(batch, list) and len(batch) > 1 and all(isinstance(p, (str, list)) for p in batch):
            return APIError(400, f"prompt: one prompt a request, not a batch of {len(batch)}", param="prompt")
        if len(deepest["loc"]) > len(path) + 2:
            path, message = path + _field_path(deepest["loc"][len(path) + 2:]), deepest["msg"]
        else:
            message = f"expected {_UNION_FORMS.get(path[-1], 'another kind of value')}"
    where = ".".join(str(part) for part in path)
    return APIError(400, f"{where}: {message}", param=where)


def _field_path(loc: tuple) -> tuple:
    """The fields, indexes and keys of ``loc`` up to the first union branch pydantic names."""
    path = []
    for index, part in enumerate(loc):
        is_key = index == 1 and loc[0] in _MAPPINGS  # whatever it spells
        if not is_key and isinstance(part, str) and (not part.isidentifier() or part in _BRANCH_NAMES):
            break
        path.append(part)
    return tuple(path)


# Union branches pydantic names after a type that is also a valid identifier.
_BRANCH_NAMES = {"str", "int", "float", "bool", "list", "dict", "TextPart"}
# The request's fields that map keys to values (a key follows the field in an error's location).
_MAPPINGS = {"logit_bias"}
# How the union fields' accepted forms read.
_UNION_FORMS = {
    "prompt": "a string, a list of token ids, or a list of one string or one list of token ids",
    "stop": "a string or a list of up to 4 non-empty strings",
    "content": "a string or a list of text parts",
}


def _chat_message(message, index: int) -> dict:
    """A request's chat message as chat templates take it."""
    out = {"role": message.role, "content": _text(message.text(), f"messages.{index}.content")}
    if message.tool_call_id is not None:
        out["tool_call_id"] = message.tool_call_id
    if message.role == "tool" and message.name is not None:
        out["name"] = message.name
    if message.tool_calls:
        out["tool_calls"] = []
        for call in message.tool_calls:
            out["tool_calls"].append({"id": call.id, "type": "function",
                                      "function": {"name": call.function.name, "arguments": _arguments(call)}})
    return out


def _arguments(call) -> object:
    """A tool call's arguments as chat templates take them: a dict if they are a JSON object, else their text as
    it is (OpenAI takes back a call whose arguments a model got wrong)."""
    try:
        arguments = json.loads(call.function.arguments)
    except (ValueError, RecursionError):  # not JSON, or nested too deep to read
        return call.function.arguments
    return arguments if isinstance(arguments, dict) else call.function.arguments


def _document(tokenizer, text: str):
    """A completion's prompt ``text`` as token ids; an empty one starts a new document, as OpenAI's does: the
    tokenizer's BOS if it adds one, else its EOS token, which ends a document."""
    if tokenizer is None:
        return text  # the engine refuses text without a tokenizer
    return encode_text(tokenizer, text) or [tokenizer.eos_token_id]


def _bias_checked(prompt, bias: dict[int, float]):
    """``prompt`` (token ids, or a function of the tokenizer giving them) as a function of the tokenizer that
    first checks that ``bias`` names the tokenizer's tokens: it runs with the tokenizer of the engine that
    takes the request, before the engine has it."""

    def checked(tokenizer):
        if tokenizer is None:
            raise APIError(400, "logit_bias needs the model's tokenizer: this server has none", param="logit_bias")
        outside = sorted(token for token in bias if token >= len(tokenizer))
        if outside:
            raise APIError(400, f"logit_bias: token id {outside[0]} is not in the model's vocabulary "
                           f"[0, {len(tokenizer)})", param="logit_bias")
        return prompt(tokenizer) if callable(prompt) else prompt

    return checked


def _text(text: str, param: str) -> str:
    """``text``, if it is valid Unicode (JSON can carry a lone surrogate, which no tokenizer encodes)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise APIError(400, f"{param} holds a lone surrogate (\\u{ord(text[e.start]):04x}), which is not text",
                       param=param) from None
    return text


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


class _Run:
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
            raise _request_error(e) from None

    async def rest(self) -> AsyncIterator[StreamChunk]:
        try:
            while self.pending or self.final is None:
                chunk = self.pending.pop(0) if self.pending else await self._next()
                yield chunk
        except Exception as e:  # mid-stream: the stream ends with this error event
            raise _server_error(e) from None
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


def _request_error(error: Exception) -> APIError:
    """What the client reads when its request cannot run: a 400, unless the server, not the request, failed."""
    if isinstance(error, TemplateError):
        return APIError(400, f"the chat template rejects these messages: {one_line(error)}", param="messages")
    if isinstance(error, (ValueError, TypeError)):
        return APIError(400, one_line(error))
    return _server_error(error)


def _server_error(error: Exception) -> APIError:
    """What the client reads when the server, not its request, failed."""
    if isinstance(error, APIError):
        return error
    if isinstance(error, LoopStopped):
        return APIError(503, "the server is shutting down", type="server_error")
    return APIError(500, f"the engine failed: {one_line(error)}", type="server_error")


@dataclass
class _Shape:
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
            return _event(self.chunk(chunk, usage=usage, text=text, tool_calls=calls))
        if self._template is None:  # the text is the last string in the chunk: what follows it holds no string
            head, _, tail = _event(self.chunk(StreamChunk(0, [], _MARK), usage=usage)).rpartition(json.dumps(_MARK))
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


def _event(body: dict) -> str:
    return f"data: {json.dumps(body)}\n\n"
