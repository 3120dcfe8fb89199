"""The OpenAI-compatible server, in this process on a free port, driven by the real ``openai`` client.

The model is SmolLM2 (tests/smollm2.py); texts are compared with mlx-lm's greedy generation.
"""

import asyncio
import contextlib
import gc
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Iterator

import httpx
import openai
import pytest
import uvicorn
from faults import Fault
from models import tiny_model
from smollm2 import smollm2_dir
from test_engine_loop import read_within, wait_until
from test_plugin import FRANCE, loaded, mlx_lm_answer

from llm_paged_mlx import Engine, SamplingParams, engines
from llm_paged_mlx.catalog import CACHE_ENV
from llm_paged_mlx.engine.disk.admin import block_files
from llm_paged_mlx.engine.loop import EXIT_WAIT_S, EngineLoop, Submission, exit_at_once
from llm_paged_mlx.options import PagedOptions, serving_config
from llm_paged_mlx.server import ServedModel, create_app
from llm_paged_mlx.server.metrics import ServerMetrics

MODEL = "smollm2"
KEY = "test-key"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Running:
    """An app served by uvicorn on a thread of this process."""

    def __init__(self, app):
        self.port = free_port()
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        while not self.server.started:
            assert self.thread.is_alive()
            time.sleep(0.01)
        self.url = f"http://127.0.0.1:{self.port}"

    def stop(self):
        self.server.should_exit = True
        self.thread.join(timeout=30)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    os.environ.setdefault("LLM_USER_PATH", str(tmp_path_factory.mktemp("llm")))
    folder = str(smollm2_dir())
    loop = engines.engine_loop(MODEL, folder, lambda: folder)
    config = serving_config(PagedOptions(kv_budget="64MB", kv_disk_budget=0))
    loop.prepare(config).result()
    return ServedModel(MODEL, loop, config, aliases=("smol",), defaults={"max_tokens": 64}, max_tokens_limit=512)


@pytest.fixture(scope="module")
def server(served):
    running = Running(create_app(served, api_key=KEY))
    yield running
    running.stop()


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0)


def chat(question):
    return [{"role": "user", "content": question}]


def metric(server, name) -> float:
    text = httpx.get(f"{server.url}/metrics").text
    match = re.search(rf"^{re.escape(name)}{{[^}}]*}} (\S+)$", text, re.MULTILINE)
    assert match, f"{name} not in /metrics"
    return float(match.group(1))


def completion_reference(prompt: str, max_tokens: int) -> str:
    """mlx-lm's greedy tokens after ``prompt``, as text that continues it (its leading space kept)."""
    from mlx_lm.generate import stream_generate
    from mlx_lm.sample_utils import make_sampler

    model, tokenizer = loaded(str(smollm2_dir()))
    pieces = stream_generate(model, tokenizer, prompt, max_tokens=max_tokens, sampler=make_sampler(temp=0.0))
    generated = [r.token for r in pieces if r.token not in tokenizer.eos_token_ids]
    prompt_ids = tokenizer.encode(prompt)
    return tokenizer.decode(prompt_ids + generated)[len(tokenizer.decode(prompt_ids)):]


# -- the API ------------------------------------------------------------------


def test_chat_completion_gives_mlx_lm_text_and_usage(client):
    response = client.chat.completions.create(model=MODEL, messages=chat(FRANCE), max_tokens=24, temperature=0)
    assert response.choices[0].message.content == mlx_lm_answer(smollm2_dir(), FRANCE, 24)
    assert response.choices[0].finish_reason == "stop" and response.object == "chat.completion"
    assert response.choices[0].logprobs is None  # not asked for
    _, tokenizer = loaded(str(smollm2_dir()))
    prompt_tokens = len(tokenizer.apply_chat_template(chat(FRANCE), add_generation_prompt=True))
    usage = response.usage
    assert usage.prompt_tokens == prompt_tokens and 0 < usage.completion_tokens <= 24
    assert usage.total_tokens == prompt_tokens + usage.completion_tokens
    again = client.chat.completions.create(model="smol", messages=chat(FRANCE), max_tokens=24)
    assert again.choices[0].message.content == response.choices[0].message.content
    assert again.usage.prompt_tokens_details.cached_tokens >= 16  # the prefix cache's hit


def test_streamed_chat_gives_the_same_text_and_usage_last(client):
    question = "Tell me about Paris."
    stream = client.chat.completions.create(model=MODEL, messages=chat(question), max_tokens=20, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == mlx_lm_answer(smollm2_dir(), question, 20)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert not chunks[-1].choices and chunks[-1].usage.completion_tokens == 20
    assert all(c.usage is None for c in chunks[:-1])


@pytest.mark.parametrize("kind", ["chat.completion", "text_completion"])
@pytest.mark.parametrize("usage", [False, True])
def test_a_text_chunks_event_is_the_whole_chunk_encoded(kind, usage):
    from llm_paged_mlx.engine.output import StreamChunk
    from llm_paged_mlx.server.responses import Shape, event

    for model in ["a \"model\"\n", "\x00"]:
        shape = Shape(kind, "id-1", model, created=7, tokenizer=None, logprobs=False)
        for text in ["", " Paris", 'say "hi"\n\\', "\x00 \u2028 é 😀", None]:
            chunk = StreamChunk(3, [5], text)
            assert shape.event(chunk, usage) == event(shape.chunk(chunk, usage=usage))


def test_completions_plain_and_streamed(client):
    prompt = "The capital of France is"
    expected = completion_reference(prompt, 12)
    response = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12)
    assert response.choices[0].text == expected and response.usage.completion_tokens == 12
    assert expected.startswith(" ")  # prompt + text reads right
    streamed = "".join(c.choices[0].text for c in client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, stream=True))
    assert streamed == expected
    _, tokenizer = loaded(str(smollm2_dir()))
    by_ids = client.completions.create(model=MODEL, prompt=tokenizer.encode(prompt), max_tokens=12)
    assert by_ids.choices[0].text == expected


@pytest.mark.parametrize("prompt, continuation", [
    ("The capital of France is", " Paris, é 😀 and\n  more."),
    ("The capital of France is ", "Paris."),  # the prompt's last token is a lone space
    ("Tokens:", "\u00e9\u00e9 \u4e2d\u6587"),  # multi-byte characters split across tokens
])
def test_a_completions_text_continues_its_prompt(prompt, continuation):
    from llm_paged_mlx.engine.output import OutputText

    _, tokenizer = loaded(str(smollm2_dir()))
    prompt_ids, generated = tokenizer.encode(prompt), tokenizer.encode(continuation)
    text = OutputText(tokenizer, None, after=prompt_ids[-1])
    streamed = []
    for token in generated:
        text.add(token)
        streamed.append(text.take(final=False))
    text.finish()
    streamed.append(text.take(final=True))
    assert "".join(streamed) == tokenizer.decode(prompt_ids + generated)[len(tokenizer.decode(prompt_ids)):]


def test_logprobs_are_the_models(client):
    response = client.chat.completions.create(model=MODEL, messages=chat(FRANCE), max_tokens=4, logprobs=True,
                                              top_logprobs=3)
    entries = response.choices[0].logprobs.content
    assert len(entries) == response.usage.completion_tokens and all(len(e.top_logprobs) == 3 for e in entries)
    for entry in entries:  # greedy: the chosen token is the most likely one
        assert entry.top_logprobs[0].token == entry.token and entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)
        assert entry.logprob <= 0 and entry.top_logprobs[1].logprob <= entry.logprob
    legacy = client.completions.create(model=MODEL, prompt="One, two,", max_tokens=3, logprobs=2)
    assert len(legacy.choices[0].logprobs.token_logprobs) == 3 and all(len(t) <= 2 for t in legacy.choices[0].logprobs.top_logprobs)
    streamed = client.completions.create(model=MODEL, prompt="One, two,", max_tokens=3, logprobs=2, stream=True)
    parts = [c.choices[0].logprobs for c in streamed if c.choices[0].logprobs and c.choices[0].logprobs.tokens]
    assert [t for part in parts for t in part.tokens] == legacy.choices[0].logprobs.tokens
    assert [o for part in parts for o in part.text_offset] == legacy.choices[0].logprobs.text_offset  # from the text's start


def test_stop_strings_and_seeded_sampling(client):
    stopped = client.chat.completions.create(model=MODEL, messages=chat(FRANCE), max_tokens=24, stop=["Paris"])
    assert stopped.choices[0].message.content == "The capital of France is " and stopped.choices[0].finish_reason == "stop"
    sampled = [
        client.chat.completions.create(model=MODEL, messages=chat("Write a poem."), max_tokens=12, temperature=1.0,
                                       top_p=0.9, seed=7).choices[0].message.content
        for _ in range(2)
    ]
    assert sampled[0] == sampled[1]


def test_prompts_are_tokenized_off_the_loops_thread(client, monkeypatch):
    """A long prompt's tokenization (or chat template) must not hold up the loop and every running request."""
    from llm_paged_mlx.server import app, prompts

    threads = []
    for module, name in ((prompts, "encode_text"), (app, "render_prompt")):
        original = getattr(module, name)

        def recorded(*args, original=original):
            threads.append(threading.current_thread().name)
            return original(*args)

        monkeypatch.setattr(module, name, recorded)
    client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=2)
    client.chat.completions.create(model=MODEL, messages=chat(FRANCE), max_tokens=2)
    assert len(threads) == 2 and all(t != "llm-paged-mlx" and t != threading.main_thread().name for t in threads), threads


def test_models_and_health(client, server):
    assert [m.id for m in client.models.list().data] == [MODEL, "smol"]
    assert client.models.retrieve("smol").id == "smol"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4o")
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}


def test_64_concurrent_streaming_clients_all_finish(server):
    async def one(client, i):
        stream = await client.chat.completions.create(
            model=MODEL, messages=chat(f"Write a story about the number {i}."), max_tokens=8 + i % 5, stream=True,
            stream_options={"include_usage": True}, temperature=0,
        )
        usage, reasons = None, []
        async for chunk in stream:
            usage = chunk.usage or usage
            reasons += [c.finish_reason for c in chunk.choices if c.finish_reason]
        return usage.completion_tokens, reasons

    async def main():
        async with openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=600) as client:
            return await asyncio.gather(*(one(client, i) for i in range(64)))

    results = asyncio.run(main())
    assert [reasons for _, reasons in results] == [["length"]] * 64
    assert [count for count, _ in results] == [8 + i % 5 for i in range(64)]
    assert metric(server, "vllm:num_requests_running") == 0 and metric(server, "vllm:kv_cache_usage_perc") == 0


def test_a_client_that_disconnects_mid_stream_frees_its_blocks(client, server):
    stream = client.chat.completions.create(model=MODEL, messages=chat("Write a long story about a dragon."),
                                            max_tokens=500, stream=True)
    for _, chunk in zip(range(4), stream):
        pass
    assert metric(server, "vllm:num_requests_running") == 1 and metric(server, "vllm:kv_cache_usage_perc") > 0
    stream.close()
    wait_until(lambda: metric(server, "vllm:kv_cache_usage_perc") == 0
               and metric(server, "vllm:num_requests_running") == 0)  # fmt: skip


# -- bad input ----------------------------------------------------------------


def post(server, path, body=None, *, content=None, key=KEY, **headers):
    headers = {**({"Authorization": f"Bearer {key}"} if key else {}), **headers}
    return httpx.post(f"{server.url}{path}", json=body, content=content, headers=headers, timeout=60)


def assert_error(response, status, *words):
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    for word in words:
        assert word in error["message"], error["message"]
    return error


@pytest.mark.parametrize("key", [None, "wrong-key", KEY + "x", ""])
def test_missing_or_wrong_key_is_401(server, key):
    body = {"model": MODEL, "messages": chat("hi")}
    error = assert_error(post(server, "/v1/chat/completions", body, key=key), 401, "API key")
    assert error["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{server.url}/v1", api_key=key or "none", max_retries=0).models.list()


def test_malformed_bodies_are_400(server):
    headers = {"Content-Type": "application/json"}
    assert_error(post(server, "/v1/chat/completions", content=b"{not json", **headers), 400, "not valid JSON")
    assert_error(post(server, "/v1/chat/completions", content=b"[1, 2]", **headers), 400)
    assert_error(post(server, "/v1/chat/completions", {"model": MODEL}), 400, "messages")
    assert_error(post(server, "/v1/chat/completions", {"model": MODEL, "messages": []}), 400, "messages")
    bad = {"model": MODEL, "messages": [{"role": "robot", "content": "hi"}]}
    assert_error(post(server, "/v1/chat/completions", bad), 400, "messages.0.role")
    for field, value in [("temperature", -1), ("top_p", 0), ("max_tokens", 0), ("n", 2), ("stop", [""]),
                         ("top_logprobs", 21), ("presence_penalty", 1.0), ("tools", [{"type": "function"}])]:
        body = {"model": MODEL, "messages": chat("hi"), field: value}
        assert_error(post(server, "/v1/chat/completions", body), 400, field)
    image = [{"type": "image_url", "image_url": {"url": "http://x"}}]
    assert_error(post(server, "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": image}]}), 400)
    assert_error(post(server, "/v1/completions", {"model": MODEL, "prompt": ["a", "b"]}), 400, "one prompt a request")
    assert_error(post(server, "/v1/completions", {"model": MODEL, "prompt": [10**9]}), 400, "vocabulary")
    assert_error(post(server, "/v1/completions", {"model": MODEL, "prompt": {"a": 1}}), 400,
                 "prompt: expected a string, a list of token ids")  # not pydantic's names for the union's branches
    assert_error(post(server, "/v1/completions", {"model": MODEL, "prompt": [1, True]}), 400, "prompt.1", "not a boolean")
    assert_error(post(server, "/v1/completions", {"model": MODEL, "prompt": [1, 2.5]}), 400, "prompt.1")
    lone_surrogate = b'{"model": "smollm2", "messages": [{"role": "user", "content": "a\\ud800"}]}'
    assert_error(post(server, "/v1/chat/completions", content=lone_surrogate, **headers), 400,
                 "messages.0.content", "lone surrogate")
    assert_error(post(server, "/v1/chat/completions", content=b'{"model": "smollm2",', **headers), 400,
                 "not valid JSON", "at character 20")
    form = post(server, "/v1/chat/completions", content=b'{"model": "smollm2"}',
                **{"Content-Type": "application/x-www-form-urlencoded"})
    assert_error(form, 400, "Content-Type: application/json")
    assert_error(post(server, "/v1/chat/completions", {"model": MODEL, "messages": chat("hi"), "top_logprobs": 2}),
                 400, "top_logprobs needs logprobs")
    wrong_method = httpx.get(f"{server.url}/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"})
    assert_error(wrong_method, 405)
    assert wrong_method.headers["allow"] == "POST"


def test_null_is_the_default_for_optional_fields(server):
    nulls = {name: None for name in ("n", "stream", "stream_options", "logprobs", "top_logprobs", "presence_penalty",
                                     "frequency_penalty", "temperature", "top_p", "seed", "stop", "user")}
    response = post(server, "/v1/chat/completions", {"model": MODEL, "messages": chat("hi"), "max_tokens": 2, **nulls})
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 2 and response.json()["choices"][0]["logprobs"] is None


def test_tools_for_a_model_without_a_tool_call_format_are_400(client):
    tool = {"type": "function", "function": {"name": "llm_time", "parameters": {}}}
    with pytest.raises(openai.BadRequestError, match="cannot call tools"):
        client.chat.completions.create(model=MODEL, messages=chat(FRANCE), tools=[tool])


def test_response_format_json_schema_and_json_object(client):
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                               "population": {"type": "integer", "minimum": 0, "maximum": 10**8}},
              "required": ["city", "population"]}  # fmt: skip
    fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": schema}}
    reply = client.chat.completions.create(model=MODEL, messages=chat(FRANCE), max_tokens=200, response_format=fmt)
    answer = json.loads(reply.choices[0].message.content)
    assert set(answer) == {"city", "population"} and isinstance(answer["population"], int)
    stream = client.chat.completions.create(model=MODEL, messages=chat(FRANCE), max_tokens=200, response_format=fmt,
                                            stream=True)  # fmt: skip
    assert json.loads("".join(c.choices[0].delta.content or "" for c in stream)) == answer
    reply = client.chat.completions.create(model=MODEL, messages=chat("Give a JSON object with the keys name and age."),
                                           max_tokens=200, response_format={"type": "json_object"})  # fmt: skip
    assert isinstance(json.loads(reply.choices[0].message.content), dict)


@pytest.mark.parametrize(
    "fmt,words",
    [
        ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}},
         ["invalid JSON schema", "objectx"]),
        ({"type": "json_schema", "json_schema": {"schema": {}}}, ["response_format", "name"]),
        ({"type": "yaml"}, ["response_format"]),
    ],
)
def test_a_bad_response_format_is_400(client, fmt, words):
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(model=MODEL, messages=chat(FRANCE), max_tokens=4, response_format=fmt)
    for word in words:
        assert word in str(error.value)


def test_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.chat.completions.create(model="gpt-4o", messages=chat("hi"))


def test_too_long_prompt_and_too_many_tokens_are_400(client, server):
    with pytest.raises(openai.BadRequestError, match="does not fit"):
        client.chat.completions.create(model=MODEL, messages=chat("Paris " * 2000), max_tokens=4)
    with pytest.raises(openai.BadRequestError, match="at most 512"):
        client.chat.completions.create(model=MODEL, messages=chat("hi"), max_tokens=513)
    with pytest.raises(openai.BadRequestError, match="does not fit"):
        list(client.completions.create(model=MODEL, prompt="Paris " * 2000, max_tokens=4, stream=True))
    assert metric(server, "vllm:kv_cache_usage_perc") == 0


def test_a_body_over_the_limit_is_413(served):
    running = Running(create_app(served, max_body_bytes=1000))
    try:
        big = {"model": MODEL, "messages": chat("x" * 2000)}
        assert_error(post(running, "/v1/chat/completions", big, key=None), 413, "larger than 1000 bytes")
        chunked = post(running, "/v1/chat/completions", content=iter([b"{", b" " * 1500, b"}"]), key=None)
        assert_error(chunked, 413)
        assert post(running, "/v1/chat/completions", {"model": MODEL, "messages": chat("hi"), "max_tokens": 2},
                    key=None).status_code == 200
    finally:
        running.stop()


def test_a_full_queue_is_503(monkeypatch):
    """One request runs at a time here; with one waiting, the next is refused until the queue drains."""
    loop = EngineLoop(lambda config, weights: Engine(tiny_model("llama"), None, num_blocks=64, max_num_seqs=1),
                      max_waiting=1)
    loop.prepare().result()
    release, step, tokens = threading.Event(), Engine.step, []

    def held_after_the_first_token(engine):  # the running request cannot end while the queue is tried
        if tokens:
            release.wait()
        chunks = step(engine)
        tokens.extend(t for chunk in chunks for t in chunk.token_ids)
        return chunks

    monkeypatch.setattr(Engine, "step", held_after_the_first_token)
    running = Running(create_app(ServedModel("tiny", loop, max_tokens_limit=4000)))
    client = openai.OpenAI(base_url=f"{running.url}/v1", api_key="none", max_retries=0)
    try:
        first = client.completions.create(model="tiny", prompt=[1, 2, 3], max_tokens=3000, stream=True)
        next(iter(first))
        waiting = threading.Thread(target=lambda: client.completions.create(model="tiny", prompt=[4], max_tokens=2))
        waiting.start()
        wait_until(lambda: metric(running, "vllm:num_requests_waiting") >= 1)
        with pytest.raises(openai.APIStatusError, match="busy") as refused:
            client.completions.create(model="tiny", prompt=[5], max_tokens=2)
        assert refused.value.status_code == 503
        release.set()
        first.close()
        waiting.join(timeout=120)
        assert client.completions.create(model="tiny", prompt=[5], max_tokens=2).usage.completion_tokens == 2
    finally:
        release.set()
        running.stop()
        loop.stop()


# -- failures, clients that go, and stopping ------------------------------------


def tiny_engine(config=None, weights=None) -> Engine:
    return Engine(tiny_model("llama"), None, num_blocks=64)


async def asgi_call(app, path: str, body: dict, disconnect_after=None) -> tuple[int, bytes]:
    """POST ``body`` to ``app`` as an ASGI server would, the client disconnecting after ``disconnect_after``
    (seconds, or a coroutine function to await; None: never); the response's status and body."""
    pending = [{"type": "http.request", "body": json.dumps(body).encode(), "more_body": False}]
    sent = []

    async def receive():
        if pending:
            return pending.pop(0)
        if callable(disconnect_after):
            await disconnect_after()
        else:
            await asyncio.sleep(3600 if disconnect_after is None else disconnect_after)
        return {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "",
             "headers": [(b"content-type", b"application/json")], "client": ("127.0.0.1", 1),
             "server": ("127.0.0.1", 80)}
    await app(scope, receive, send)
    status = next(m["status"] for m in sent if m["type"] == "http.response.start")
    return status, b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")


async def until(condition, timeout: float = 120) -> None:
    """Poll ``condition`` from a coroutine until it holds; ``timeout`` bounds a hang."""

    async def poll():
        while not condition():
            await asyncio.sleep(0.005)

    await asyncio.wait_for(poll(), timeout)


def test_a_client_gone_before_its_answer_gets_none_and_frees_its_blocks(monkeypatch):
    """Not streamed: gone mid-generation, or before the loop took the request (it was busy): no answer is built
    (no 500 for a response nobody reads), the handler does not hang, and no block stays in use."""
    loop = EngineLoop(tiny_engine)
    loop.prepare().result()
    app = create_app(ServedModel("tiny", loop, max_tokens_limit=5000))
    body = {"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 4000}
    cancelled, cancel, step, tokens = threading.Event(), Submission.cancel, Engine.step, []

    def cancel_told(submission):
        cancel(submission)
        cancelled.set()

    def held_until_a_cancel(engine):  # after its first token, the request cannot end before its client has gone
        if tokens:
            cancelled.wait()
        chunks = step(engine)
        tokens.extend(t for chunk in chunks for t in chunk.token_ids)
        return chunks

    async def mid_generation():
        await until(lambda: tokens)

    monkeypatch.setattr(Submission, "cancel", cancel_told)
    monkeypatch.setattr(Engine, "step", held_until_a_cancel)
    assert asyncio.run(asgi_call(app, "/v1/completions", body, disconnect_after=mid_generation)) == (499, b"")
    admitting, release = threading.Event(), threading.Event()

    def slow_prompt(tokenizer):
        admitting.set()
        release.wait()
        return [1]

    blocker = loop.submit(slow_prompt, SamplingParams(max_tokens=1))
    admitting.wait()

    async def gone_while_the_loop_is_busy():
        call = asyncio.create_task(asgi_call(app, "/v1/completions", body, disconnect_after=0))
        # submitted, and cancelled by the disconnect, while the loop is still busy
        await until(lambda: [s.cancelled for s in list(loop._outstanding) if s is not blocker] == [True])
        release.set()
        return await asyncio.wait_for(call, 30)

    assert asyncio.run(gone_while_the_loop_is_busy()) == (499, b"")
    list(blocker)
    wait_until(lambda: loop.stats["used_blocks"] == 0 and loop.num_waiting() == 0)
    loop.stop()


def test_an_engine_that_keeps_failing_gives_server_errors_and_the_server_goes_on(monkeypatch):
    loop = EngineLoop(tiny_engine)
    loop.prepare().result()
    running = Running(create_app(ServedModel("tiny", loop, max_tokens_limit=5000)))
    client = openai.OpenAI(base_url=f"{running.url}/v1", api_key="none", max_retries=0)
    failing, step = threading.Event(), Engine.step

    def step_that_may_fail(engine):
        if failing.is_set():
            raise Fault("injected")
        return step(engine)

    monkeypatch.setattr(Engine, "step", step_that_may_fail)
    try:
        stream = client.completions.create(model="tiny", prompt=[1, 2, 3], max_tokens=4000, stream=True)
        next(iter(stream))
        failing.set()
        with pytest.raises(openai.APIError, match="the engine failed 3 steps in a row: injected"):
            list(stream)  # the stream ends with an error event
        with pytest.raises(openai.InternalServerError, match="the engine failed"):
            client.completions.create(model="tiny", prompt=[4], max_tokens=2)
        failing.clear()
        assert client.completions.create(model="tiny", prompt=[4], max_tokens=2).usage.completion_tokens == 2
        assert metric(running, "vllm:kv_cache_usage_perc") == 0
    finally:
        running.stop()
        loop.stop()


def test_a_request_waiting_when_the_server_stops_gets_503():
    building, release = threading.Event(), threading.Event()

    def slow_build(config, weights):
        building.set()
        release.wait()
        return tiny_engine()

    loop = EngineLoop(slow_build)
    app = create_app(ServedModel("tiny", loop))

    async def stopped_while_waiting():
        call = asyncio.create_task(asgi_call(app, "/v1/completions", {"model": "tiny", "prompt": [1], "max_tokens": 2}))
        await asyncio.to_thread(building.wait)
        loop.request_stop()
        return await asyncio.wait_for(call, 30)  # at once, though the loop's thread is still busy

    status, body = asyncio.run(stopped_while_waiting())
    assert status == 503 and json.loads(body)["error"]["message"] == "the server is shutting down"
    release.set()
    loop.stop()


# Why the server may refuse a request its schema calls valid: this server's token limit, this model's vocabulary
# and what it cannot do, and the one rule between fields that the schema does not state.
REFUSED_FOR_THE_SERVER = ("this server allows at most", "does not fit", "vocabulary", "cannot call tools",
                          "the chat template rejects these messages", "top_logprobs needs logprobs")


@pytest.fixture(scope="module")
def random_served():
    """A tiny random llama with SmolLM2's tokenizer and chat template: generated prompts of any length run fast."""
    tokenizer = loaded(str(smollm2_dir()))[1]
    model = tiny_model("llama", vocab_size=len(tokenizer))
    loop = EngineLoop(lambda config, weights: Engine(model, tokenizer, num_blocks=256))
    loop.prepare().result()
    yield ServedModel(MODEL, loop, defaults={"max_tokens": 2}, max_tokens_limit=4)
    loop.stop()


@pytest.mark.parametrize("mode", ["positive", "negative"])
def test_schemathesis_finds_no_server_error_and_no_response_off_the_schema(random_served, mode):
    """Generated requests against the OpenAPI schema: no 5xx and every response as documented; a valid body
    (for the served model: another is a 404 before the body counts) is answered, an invalid one refused."""
    import schemathesis
    from hypothesis import HealthCheck, Phase, given, settings
    from schemathesis.checks import not_a_server_error
    from schemathesis.specs.openapi.checks import (content_type_conformance, negative_data_rejection,
                                                   response_schema_conformance, status_code_conformance)

    schema = schemathesis.openapi.from_asgi("/openapi.json", create_app(random_served))
    checks = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]
    positive = mode == "positive"
    for operation in schema.get_all_operations():
        operation = operation.ok()
        if not positive and operation.method.upper() != "POST":
            continue  # nothing of the GET operations can be invalid but their path's model name

        @settings(max_examples=15, derandomize=True, deadline=None, database=None, phases=[Phase.generate],
                  suppress_health_check=list(HealthCheck))  # fmt: skip: no shrinking, which takes minutes here
        @given(case=operation.as_strategy(getattr(schemathesis.GenerationMode, mode.upper())))
        def run(case):
            if positive and isinstance(case.body, dict):
                case.body["model"] = MODEL
            response = case.call()
            case.validate_response(response, checks=checks if positive else [*checks, negative_data_rejection])
            if positive and case.body is not schemathesis.core.NOT_SET and response.status_code != 200:
                message = response.json()["error"]["message"]
                assert any(reason in message for reason in REFUSED_FOR_THE_SERVER), message

        run()


# -- the command --------------------------------------------------------------


# `llm paged-mlx serve ...` whose prefill of a long prompt never ends, as a long prefill on a CPU outlasts the
# exit's wait for it (made argv[1] seconds here); it prints a line as that prefill begins and as the exit begins
# to wait for it.
HELD_PREFILL_SERVE = """
import os, sys, threading
from llm.cli import cli
from llm_paged_mlx import Engine
from llm_paged_mlx.engine import loop

loop.EXIT_WAIT_S = float(sys.argv.pop(1))
step, stop_at_exit = Engine.step, loop.EngineLoop._stop_at_exit

def held_in_a_long_prefill(engine):
    if any(len(request.prompt_token_ids) > 200 for request in engine.requests.values()):
        os.write(1, b"prefilling\\n")
        threading.Event().wait()
    return step(engine)

def stop_at_exit_told(engine_loop):
    os.write(1, b"the exit waits for the step\\n")
    stop_at_exit(engine_loop)

Engine.step, loop.EngineLoop._stop_at_exit = held_in_a_long_prefill, stop_at_exit_told
cli(sys.argv[1:])
"""


def serve_process(tmp_path, *args, exit_wait_s: float = None) -> subprocess.Popen:
    """``llm paged-mlx serve ARGS``; given ``exit_wait_s``, through HELD_PREFILL_SERVE."""
    env = {**os.environ, "LLM_USER_PATH": str(tmp_path / "llm"), CACHE_ENV: str(smollm2_dir().parent)}
    llm = [Path(sys.executable).parent / "llm"]
    if exit_wait_s is not None:
        llm = [sys.executable, "-c", HELD_PREFILL_SERVE, str(exit_wait_s)]
    return subprocess.Popen([*llm, "paged-mlx", "serve", *map(str, args)], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def read_until(process: subprocess.Popen, line: str) -> None:
    """Read the process's stdout up to ``line`` (one of HELD_PREFILL_SERVE's)."""
    found = read_within(lambda: any(read == line + "\n" for read in process.stdout))
    assert found, f"{line!r} never came: {process.communicate()[1]}"


def test_serve_command_answers_and_stops_cleanly_on_ctrl_c(tmp_path):
    port = free_port()
    process = serve_process(tmp_path, "paged-smollm2", "--port", port, "-o", "kv_budget", "64MB", "-o", "max_tokens", 6)
    try:
        wait_for_health(process, port)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)
        response = client.chat.completions.create(model="paged-smollm2", messages=chat(FRANCE))
        assert response.usage.completion_tokens == 6  # the -o max_tokens default
        stream = client.chat.completions.create(model="paged-smollm2", messages=chat("Write a long story."),
                                                max_tokens=400, stream=True)
        next(iter(stream))
        process.send_signal(signal.SIGINT)
        with pytest.raises(openai.APIError, match="shutting down"):  # the open stream ends, it does not hang
            list(stream)
        _, stderr = process.communicate(timeout=60)
    finally:
        process.kill()
    assert process.returncode == 0, stderr
    assert "Traceback" not in stderr and "Serving paged-smollm2 on http://127.0.0.1" in stderr
    assert not disk_blocks(tmp_path)  # a server has no disk tier unless asked


SIGNAL_INSIDE_SUBMIT = """
import asyncio, signal
import uvicorn
from llm_paged_mlx.engine.loop import EngineLoop, exit_at_once
from llm_paged_mlx.server import _Server

loop = EngineLoop(lambda config, weights: None)
server = _Server(uvicorn.Config(app=None), loop)

async def signalled_inside_submit():
    with loop._lock:  # as ``submit`` holds it when the handler interrupts it
        server.handle_exit(signal.SIGINT, None)
    await asyncio.sleep(0)

asyncio.run(signalled_inside_submit())
assert loop.parked.wait(120) and server.should_exit  # the stop began once the handler had returned
assert signal.getsignal(signal.SIGINT) is exit_at_once  # and a second signal ends the process
"""


def test_after_uvicorn_its_exit_signal_ends_run_and_a_second_signal_ends_the_process(monkeypatch):
    """uvicorn puts back the handler it found and raises its exit signal again: that ends ``run``; a second
    Ctrl-C while asyncio then shuts down ends the process at once (a KeyboardInterrupt there left uvloop's
    executor thread calling a closed loop, with a traceback)."""
    import llm_paged_mlx.server as server

    def exit_at_once(signum, frame):
        raise SystemExit(128 + signum)

    monkeypatch.setattr(server, "exit_at_once", exit_at_once)
    handler = server._InterruptOnce()
    with pytest.raises(KeyboardInterrupt):
        handler(signal.SIGINT, None)
    with pytest.raises(SystemExit, match="130"):
        handler(signal.SIGINT, None)


def test_after_its_exit_signal_run_leaves_the_exit_to_a_second_signal_and_to_status_0(monkeypatch):
    """Once ``run`` has returned, the exit may wait for a step: a second Ctrl-C or SIGTERM still ends the process
    at once (with Python's handlers back, Ctrl-C there was llm's "Aborted!" and a wait), and a step that outlasts
    the wait ends it with 0, as one that ends in time does."""
    import llm_paged_mlx.server as server

    def stopped_by_its_exit_signal(self):
        raise KeyboardInterrupt  # as _InterruptOnce raises it

    monkeypatch.setattr(server._Server, "run", stopped_by_its_exit_signal)
    loop = EngineLoop(tiny_engine)
    before = {signum: signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM)}
    try:
        server.run(ServedModel("tiny", loop), "127.0.0.1", free_port())
        assert [signal.getsignal(signum) for signum in before] == [exit_at_once, exit_at_once]
    finally:
        for signum, handler in before.items():
            signal.signal(signum, handler)
    assert loop.exit_status_past_wait == 0
    loop.stop()


def run_tiny_server(server) -> None:
    """``server.run`` over a tiny engine's loop (the caller patches ``_Server.run``), its signal handlers put back."""
    loop = EngineLoop(tiny_engine)
    before = {signum: signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM)}
    try:
        server.run(ServedModel("tiny", loop), "127.0.0.1", free_port())
    finally:
        for signum, handler in before.items():
            signal.signal(signum, handler)
        loop.stop()


def test_the_server_freezes_the_heap_it_starts_with_while_it_serves(monkeypatch):
    """What exists when ``run`` starts (the model, the engine) is out of the collector's full collections while
    the server runs, and back in them once it has returned."""
    import llm_paged_mlx.server as server

    frozen = []
    monkeypatch.setattr(server._Server, "run", lambda self: frozen.append(gc.get_freeze_count()))
    run_tiny_server(server)
    assert frozen[0] > 1000
    assert gc.get_freeze_count() == 0


def test_a_heap_frozen_before_the_server_stays_frozen_after_it(monkeypatch):
    """``run`` undoes only its own freeze: a heap its caller froze is left frozen."""
    import llm_paged_mlx.server as server

    monkeypatch.setattr(server._Server, "run", lambda self: None)
    gc.freeze()
    try:
        run_tiny_server(server)
        assert gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()


def test_a_tensor_parallel_follower_freezes_its_heap_once_its_engine_is_built(monkeypatch):
    """A rank that follows rank 0's server keeps its engine until it ends, and freezes as the server does."""
    from llm_paged_mlx import cli

    frozen = []
    monkeypatch.setattr(cli, "_find_model", lambda name: (name, None, None, ()))
    build = lambda: frozen.append(gc.get_freeze_count())  # noqa: E731
    monkeypatch.setattr(cli, "engine_builder", lambda model_id, fetch, group: build)
    monkeypatch.setattr(cli.ranks, "replay", lambda build, group: build())
    try:
        cli._follow("tiny", {}, group=None)
        assert frozen == [0] and gc.get_freeze_count() > 1000
    finally:
        gc.unfreeze()


def test_an_exit_signal_that_lands_inside_submit_does_not_deadlock():
    run = subprocess.run([sys.executable, "-c", SIGNAL_INSIDE_SUBMIT], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr


@contextlib.contextmanager
def serving_a_held_prefill(tmp_path, exit_wait_s: float) -> Iterator[subprocess.Popen]:
    """HELD_PREFILL_SERVE, up and in its long prompt's prefill; killed after the block."""
    port = free_port()
    process = serve_process(tmp_path, "paged-smollm2", "--port", port, "-o", "kv_budget", "64MB",
                            exit_wait_s=exit_wait_s)
    try:
        wait_for_health(process, port)
        long_prompt = {"model": "paged-smollm2", "prompt": "Paris is lovely. " * 100, "max_tokens": 4}
        threading.Thread(target=lambda: post_to(port, long_prompt), daemon=True).start()
        read_until(process, "prefilling")
        yield process
    finally:
        process.kill()


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_an_exit_signal_during_a_long_prefill_exits_with_0_as_during_decode(tmp_path, signum):
    """SIGTERM (a service manager's stop) or Ctrl-C: the stop asked for, done when the exit stops waiting for the
    step, as when the step ends in time (test_serve_command_answers_and_stops_cleanly_on_ctrl_c,
    test_serving_beyond_this_machine_without_a_key_warns_and_sigterm_stops_it_cleanly)."""
    with serving_a_held_prefill(tmp_path, exit_wait_s=EXIT_WAIT_S) as process:
        process.send_signal(signum)
        _, stderr = process.communicate(timeout=120)
    assert process.returncode == 0 and "did not end within" in stderr and "Traceback" not in stderr, stderr


def test_ctrl_c_twice_during_a_long_step_ends_the_server_promptly(tmp_path):
    """The second Ctrl-C, while the exit waits for a prefill that never ends, ends the process at once: before
    that wait (made longer than this test's bound on a hang) runs out, and with 130."""
    with serving_a_held_prefill(tmp_path, exit_wait_s=3600) as process:
        process.send_signal(signal.SIGINT)
        read_until(process, "the exit waits for the step")
        process.send_signal(signal.SIGINT)
        _, stderr = process.communicate(timeout=120)
    assert process.returncode == 130 and "did not end within" not in stderr and "Traceback" not in stderr, stderr


def disk_blocks(tmp_path) -> list:
    """The KV disk tier's block files in the user folder of ``serve_process``."""
    folder = tmp_path / "llm" / "paged-mlx" / "kv-cache"
    return block_files(folder) if folder.exists() else []


def post_to(port: int, body: dict):
    with contextlib.suppress(httpx.HTTPError):
        httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=60)


@pytest.mark.parametrize("args, words", [
    (["no-such-model"], "neither a model of llm-paged-mlx nor a model folder"),
    (["paged-smollm2", "-o", "kv_bits", "3"], "option kv_bits"),
    (["paged-smollm2", "-o", "nosuch", "1"], "option nosuch"),
    (["paged-smollm2", "--port", "99999"], "99999"),
])
def test_serve_command_errors(tmp_path, args, words):
    process = serve_process(tmp_path, *args)
    _, stderr = process.communicate(timeout=120)
    assert process.returncode != 0 and words in stderr and "Traceback" not in stderr, stderr


def test_serving_beyond_this_machine_without_a_key_warns_and_sigterm_stops_it_cleanly(tmp_path):
    port = free_port()
    process = serve_process(tmp_path, "paged-smollm2", "--host", "0.0.0.0", "--port", port, "-o", "kv_budget", "64MB",
                            "-o", "kv_disk_budget", "64MB")
    try:
        wait_for_health(process, port)
        httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", timeout=60,
                   json={"model": "paged-smollm2", "messages": chat("Tell me about Paris. " * 4), "max_tokens": 8})
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)
        stream = client.chat.completions.create(model="paged-smollm2", messages=chat("Write a long story."),
                                                max_tokens=400, stream=True)
        next(iter(stream))
        process.send_signal(signal.SIGTERM)  # during a decode
        with pytest.raises(openai.APIError, match="shutting down"):
            list(stream)
        _, stderr = process.communicate(timeout=60)
    finally:
        process.kill()
    assert "without an API key" in stderr and process.returncode == 0 and "Traceback" not in stderr, stderr
    assert disk_blocks(tmp_path)  # -o kv_disk_budget turns the disk tier on


def wait_for_health(process: subprocess.Popen, port: int, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while True:
        assert process.poll() is None, process.communicate()[1]
        assert time.monotonic() < deadline, "the server did not start"
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)


# -- what the schema says is what the server takes ------------------------------------------------


def tool_call_with(arguments: str) -> dict:
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": arguments}}
    return {"messages": [*chat("hi"), {"role": "assistant", "content": None, "tool_calls": [call]},
                         {"role": "tool", "tool_call_id": "c1", "content": "done"}]}


@pytest.mark.parametrize("path, change, refused", [
    # accepted, as OpenAI accepts them: an empty prompt starts a new document; a call a model got wrong
    ("/v1/completions", {"prompt": ""}, None),
    ("/v1/completions", {"prompt": [""]}, None),
    ("/v1/chat/completions", tool_call_with("{not json"), None),
    ("/v1/chat/completions", tool_call_with("[1, 2]"), None),
    ("/v1/chat/completions", {"max_tokens": 2.0, "temperature": 1, "seed": 3.0}, None),  # JSON Schema's types
    ("/v1/chat/completions", {"modalities": ["text"], "logit_bias": {"5": 1}}, None),
    # values of another JSON type than the schema's
    ("/v1/chat/completions", {"max_tokens": True}, "max_tokens"),
    ("/v1/chat/completions", {"stream": "yes"}, "stream"),
    ("/v1/chat/completions", {"n": True}, "n"),
    ("/v1/chat/completions", {"logprobs": 1}, "logprobs"),
    ("/v1/chat/completions", {"seed": "5"}, "seed"),
    ("/v1/chat/completions", {"temperature": "1"}, "temperature"),
    ("/v1/chat/completions", {"presence_penalty": False}, "presence_penalty"),
    ("/v1/chat/completions", {"stream_options": {"include_usage": 1}}, "stream_options.include_usage"),
    ("/v1/completions", {"prompt": "hi", "echo": 0}, "echo"),
    ("/v1/completions", {"prompt": "hi", "logprobs": True}, "logprobs"),
    # OpenAI's fields that this server cannot honour
    ("/v1/completions", {"prompt": "hi", "best_of": 2}, "best_of"),
    ("/v1/chat/completions", {"tool_choice": "required"}, "tool_choice"),
    ("/v1/chat/completions", {"functions": [{"name": "f"}]}, "functions"),
    ("/v1/chat/completions", {"function_call": "auto"}, "function_call"),
    ("/v1/chat/completions", {"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
    ("/v1/chat/completions", {"modalities": ["text", "audio"]}, "modalities.1"),
    ("/v1/chat/completions", {"reasoning_effort": "low"}, "reasoning_effort"),
    ("/v1/chat/completions", {"verbosity": "low"}, "verbosity"),
    ("/v1/chat/completions", {"web_search_options": {}}, "web_search_options"),
    # logit_bias: token ids (as JSON's keys) to a bias from -100 to 100
    ("/v1/chat/completions", {"logit_bias": {"x": 1}}, "logit_bias"),
    ("/v1/chat/completions", {"logit_bias": {"5": 101}}, "logit_bias.5"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"5": "1"}}, "logit_bias.5"),
])  # fmt: skip
def test_the_served_schema_says_which_bodies_are_taken_and_a_refusal_names_the_field(server, path, change, refused):
    import jsonschema

    spec = httpx.get(f"{server.url}/openapi.json").json()
    name = {"/v1/completions": "CompletionRequest", "/v1/chat/completions": "ChatCompletionRequest"}[path]
    schema = jsonschema.Draft202012Validator({"$ref": f"#/components/schemas/{name}", **spec})
    body = {"model": MODEL, "max_tokens": 2, **({"messages": chat("hi")} if "chat" in path else {}), **change}
    response = post(server, path, body)
    assert schema.is_valid(body) == (refused is None), list(schema.iter_errors(body))
    if refused is None:
        assert response.status_code == 200, response.text
    else:
        assert assert_error(response, 400, refused)["param"] == refused


def test_logit_bias_is_honoured_by_both_endpoints_and_its_ids_are_the_tokenizers(client, server):
    _, tokenizer = loaded(str(smollm2_dir()))
    london, paris = (tokenizer.encode(word, add_special_tokens=False)[0] for word in (" London", " Paris"))
    forced = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=3,
                                       logit_bias={str(london): 100})  # fmt: skip
    assert forced.choices[0].text == " London" * 3
    answer = mlx_lm_answer(smollm2_dir(), FRANCE, 24)
    assert "Paris" in answer
    banned = {str(t): -100 for t in (paris, tokenizer.encode("Paris", add_special_tokens=False)[0])}
    stream = client.chat.completions.create(model=MODEL, messages=chat(FRANCE), max_tokens=24, logit_bias=banned,
                                            stream=True)  # fmt: skip
    text = "".join(c.choices[0].delta.content or "" for c in stream)
    assert text and "Paris" not in text
    for bias in ({str(len(tokenizer)): 1}, {"9" * 30: -1}):
        for path, body in [("/v1/completions", {"prompt": [1, 2]}), ("/v1/chat/completions", {"messages": chat("hi")})]:
            error = assert_error(post(server, path, {"model": MODEL, "logit_bias": bias, **body}), 400,
                                 "logit_bias", "not in the model's vocabulary [0, 49152)")  # fmt: skip
            assert error["param"] == "logit_bias"
    unbiased = client.chat.completions.create(model=MODEL, messages=chat(FRANCE), max_tokens=24)
    assert unbiased.choices[0].message.content == answer


def test_logit_bias_without_a_tokenizer_to_check_its_ids_is_400():
    loop = EngineLoop(tiny_engine)
    loop.prepare().result()
    app = create_app(ServedModel("tiny", loop))
    body = {"model": "tiny", "prompt": [1, 2], "max_tokens": 2, "logit_bias": {"5": 1}}
    status, answer = asyncio.run(asgi_call(app, "/v1/completions", body))
    assert status == 400 and "logit_bias needs the model's tokenizer" in json.loads(answer)["error"]["message"]
    assert asyncio.run(asgi_call(app, "/v1/completions", {**body, "logit_bias": None}))[0] == 200
    loop.stop()


def test_metrics_count_speculative_drafts():
    """/metrics carries the engine's draft counts under vLLM's names (its `rate` over them is the acceptance)."""
    stats = {"running": 1, "drafts": 3, "draft_tokens": 10, "accepted_draft_tokens": 7}
    text = ServerMetrics(SimpleNamespace(stats=stats, num_waiting=lambda: 0), "m").render().decode()
    for name, value in [("drafts", 3), ("draft_tokens", 10), ("accepted_tokens", 7)]:
        assert f'vllm:spec_decode_num_{name}_total{{model_name="m"}} {value}.0' in text
