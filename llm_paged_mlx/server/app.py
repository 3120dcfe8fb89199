"""The OpenAI-compatible HTTP API over one model's engine loop (FastAPI).

Every request becomes a submission to the loop, so concurrent clients share the
engine's steps. A client that disconnects cancels its request: its blocks are
free before the loop's next step. Bad input gets OpenAI's error body with a 4xx
status, never a 500 (``errors.py``). A request's fields become the engine's in
``prompts.py``; its answer takes OpenAI's form in ``responses.py``.
"""

import asyncio
import functools
import hmac
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse

from ..chat import render_prompt
from ..engine.loop import EngineLoop, LoopStopped, QueueFull
from ..engine.request import SamplingParams
from .errors import APIError, install_error_handlers, request_error, server_error
from .limits import BodySizeLimit
from .metrics import ServerMetrics
from .prompts import bias_checked, chat_message, checked_text, document, sampling_params
from .responses import Run, cancelled_on_disconnect, respond
from .schemas import (
    ChatCompletion,
    ChatCompletionRequest,
    Completion,
    CompletionRequest,
    ErrorBody,
    ModelCard,
    ModelList,
)

# The errors each API route may answer with, for the OpenAPI schema; streams are server-sent events, each of
# whose data is a chunk as JSON (the last: [DONE]).
_ERRORS = {status: {"model": ErrorBody} for status in (400, 401, 404, 413, 503)}
_EVENT = {"type": "object", "properties": {"data": {"type": "string"}}, "required": ["data"]}
_STREAM = {"content": {"text/event-stream": {"schema": _EVENT}}}


@dataclass
class ServedModel:
    """What the server serves: the model's names, its loop, the loop's config, and request defaults."""

    model_id: str
    loop: EngineLoop
    config: object = None
    aliases: tuple[str, ...] = ()
    defaults: dict = field(default_factory=dict)  # SamplingParams fields for requests that leave them out
    max_tokens_limit: int = 32768  # the most tokens a request may ask for

    def check_model(self, name: str) -> None:
        """Refuse a request for a model this server does not serve."""
        if name != self.model_id and name not in self.aliases:
            raise APIError(404, f"the model {name!r} does not exist; this server serves {self.model_id!r}",
                           param="model", code="model_not_found")


def create_app(served: ServedModel, api_key: Optional[str] = None, max_body_bytes: int = 32 * 1024**2) -> FastAPI:
    """The FastAPI app serving ``served``; ``api_key``, if given, is required as a bearer token on /v1."""
    app = FastAPI(title="llm-paged-mlx", summary="An OpenAI-compatible API over a paged-KV MLX engine")
    app.add_middleware(BodySizeLimit, limit=max_body_bytes, error=lambda message: APIError(413, message).response())
    install_error_handlers(app)
    metrics = ServerMetrics(served.loop, served.model_id)

    @app.get("/health", responses={503: {"description": "The engine loop has stopped"}})
    async def health():
        if served.loop.parked.is_set():
            return JSONResponse({"status": "stopped"}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics", response_class=PlainTextResponse, responses={200: {"description": "Prometheus text format"}})
    async def prometheus():
        return PlainTextResponse(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    authorized = _authorizer(api_key)
    _add_model_routes(app, served, authorized)
    _add_completion_routes(app, served, authorized, metrics)
    return app


def _authorizer(api_key: Optional[str]) -> Callable[[Request], None]:
    """A route dependency that refuses a request without ``api_key`` as its bearer token (None: any)."""

    def authorized(request: Request) -> None:
        if api_key is None:
            return
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), api_key.encode()):
            raise APIError(401, "missing or wrong API key: send it as 'Authorization: Bearer <key>'", code="invalid_api_key")

    return authorized


def _add_model_routes(app: FastAPI, served: ServedModel, authorized: Callable) -> None:
    created = int(time.time())

    def card(name: str) -> dict:
        return {"id": name, "object": "model", "created": created, "owned_by": "llm-paged-mlx"}

    @app.get("/v1/models", dependencies=[Depends(authorized)], response_model=ModelList, responses=_ERRORS)
    async def models():
        return {"object": "list", "data": [card(name) for name in (served.model_id, *served.aliases)]}

    @app.get("/v1/models/{model}", dependencies=[Depends(authorized)], response_model=ModelCard, responses=_ERRORS)
    async def model(model: str):
        served.check_model(model)
        return card(model)


def _add_completion_routes(app: FastAPI, served: ServedModel, authorized: Callable, metrics: ServerMetrics) -> None:
    @app.post("/v1/chat/completions", dependencies=[Depends(authorized)], response_model=ChatCompletion,
              responses={**_ERRORS, 200: _STREAM})
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        served.check_model(body.model)
        messages = [chat_message(m, i) for i, m in enumerate(body.messages)]
        if body.top_logprobs is not None and not body.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        tools = [t.model_dump(exclude_none=True) for t in body.tools or []] if body.tool_choice != "none" else []
        top = body.top_logprobs if body.top_logprobs is not None else 0
        params = sampling_params(served, body, body.max_completion_tokens or body.max_tokens,
                                 top if body.logprobs else None, json_schema=body.json_schema())  # fmt: skip
        prompt = lambda tokenizer: render_prompt(tokenizer, messages, tools)  # noqa: E731
        run = await _start(served, metrics, prompt, params, request)
        return await respond(run, body, request, "chat.completion", "chatcmpl", tools)

    @app.post("/v1/completions", dependencies=[Depends(authorized)], response_model=Completion,
              responses={**_ERRORS, 200: _STREAM})
    async def completions(body: CompletionRequest, request: Request):
        served.check_model(body.model)
        prompt = body.prompt[0] if isinstance(body.prompt, list) and isinstance(body.prompt[0], (str, list)) else body.prompt
        if isinstance(prompt, str):
            prompt = functools.partial(document, text=checked_text(prompt, "prompt"))
        params = sampling_params(served, body, body.max_tokens, body.logprobs, continues_prompt=True)
        run = await _start(served, metrics, prompt, params, request)
        return await respond(run, body, request, "text_completion", "cmpl")


async def _start(served: ServedModel, metrics: ServerMetrics, prompt, params: SamplingParams, request: Request) -> Run:
    """Submit the request and wait for its first chunk, so that an error in the prompt is a 4xx response."""
    if params.logit_bias:
        prompt = bias_checked(prompt, params.logit_bias)
    prompt = await _tokenized(served, prompt)
    try:
        submission = served.loop.submit(prompt, params, served.config)
    except QueueFull as e:
        raise APIError(503, f"the server is busy: {e}; try again later", type="server_error") from None
    except LoopStopped as e:
        raise server_error(e) from None
    run = Run(submission, metrics)
    async with cancelled_on_disconnect(request, submission):
        await run.first()
    return run


async def _tokenized(served: ServedModel, prompt):
    """The prompt's token ids, made on a worker thread so that a long prompt or chat does not hold up the
    loop's thread (and every running request with it); before the engine is built, the loop makes them."""
    tokenizer = served.loop.tokenizer
    if tokenizer is None or isinstance(prompt, list):
        return prompt
    try:
        return await asyncio.to_thread(prompt, tokenizer)  # a chat's template, or a document's text
    except Exception as e:
        raise request_error(e) from None
