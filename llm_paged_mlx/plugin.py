"""The llm plugin: MLX models served by the paged engine, as ``llm -m paged-...``.

Every prompt, sync or async, goes to its model's engine loop (``engines``), so
concurrent prompts share the engine's steps.
"""

import math
import sys
import time
from typing import Callable

import llm
from llm.parts import TextPart

from . import chat
from .catalog import builtin_models, registered_models
from .engine.loop import Submission
from .engines import ModelLoadError, engine_loop
from .errors import one_line
from .options import PagedOptions, engine_options, sampling_params


@llm.hookimpl
def register_models(register):
    for model_id, (source, fetch) in builtin_models().items():
        register(*_pair(model_id, source, fetch))
    try:
        registered = registered_models()
    except ValueError as e:
        print(f"Warning: llm-paged-mlx: {e}", file=sys.stderr)
        return
    for model_id, (source, fetch) in registered.items():
        register(*_pair(model_id, source, fetch))


@llm.hookimpl
def register_commands(cli):
    from .cli import paged_mlx

    cli.add_command(paged_mlx)


def _pair(model_id, source, fetch):
    return PagedModel(model_id, source, fetch), AsyncPagedModel(model_id, source, fetch)


def chat_messages(prompt: llm.Prompt) -> list[dict]:
    """The whole chain llm hands over (system, earlier turns, this turn) as chat messages."""
    messages = []
    for message in prompt.messages:
        text = "".join(part.text for part in message.parts if isinstance(part, TextPart))
        messages.append({"role": message.role, "content": text})
    return messages


class _Report:
    """What a response's log records: usage, timings, blocks and cache hits."""

    def __init__(self, submission: Submission):
        self.submission = submission
        self.first = None
        self.generated = 0
        self.final = None

    def add(self, chunk) -> None:
        if chunk.token_ids and self.first is None:
            self.first = time.monotonic()
        self.generated += len(chunk.token_ids)
        if chunk.finish_reason:
            self.final = chunk

    def record(self, response) -> None:
        import mlx.core as mx

        end, sub, final = time.monotonic(), self.submission, self.final
        response.set_usage(input=sub.prompt_tokens, output=self.generated)
        response.response_json = {
            "prompt_tokens": sub.prompt_tokens,
            "generated_tokens": self.generated,
            "finish_reason": final.finish_reason,
            "ttft_s": round((self.first or end) - sub.submitted, 4),
            "tokens_per_s": round((self.generated - 1) / (end - self.first), 2) if self.generated > 1 else None,
            "blocks_used": math.ceil((sub.prompt_tokens + self.generated) / sub.block_size),
            "block_size": sub.block_size,
            "prefix_cache_hit_tokens": final.num_cached_tokens,  # from memory and disk
            "disk_cache_hit_tokens": final.num_disk_cached_tokens,
            "peak_memory_bytes": mx.get_peak_memory(),
        }


class _PagedBase:
    can_stream = True

    class Options(PagedOptions, llm.Options):
        """This plugin's options on llm's base."""

    def __init__(self, model_id: str, source: str, fetch: Callable[[], str]):
        self.model_id = model_id
        self.source = source
        self.fetch = fetch

    def _submit(self, prompt) -> Submission:
        try:
            params = sampling_params(prompt.options)
        except ValueError as e:
            raise llm.ModelError(one_line(e)) from None
        messages = chat_messages(prompt)
        loop = engine_loop(self.model_id, self.source, self.fetch)
        return loop.submit(lambda tokenizer: chat.render_prompt(tokenizer, messages), params, engine_options(prompt.options))


class PagedModel(_PagedBase, llm.Model):
    def execute(self, prompt, stream, response, conversation):
        submission = self._submit(prompt)
        report = _Report(submission)
        try:
            for chunk in submission:
                report.add(chunk)
                if chunk.text:
                    yield chunk.text
        except (ModelLoadError, ValueError) as e:  # ValueError: a prompt too long for the context or the pool
            raise llm.ModelError(one_line(e)) from None
        report.record(response)


class AsyncPagedModel(_PagedBase, llm.AsyncModel):
    async def execute(self, prompt, stream, response, conversation):
        submission = self._submit(prompt)
        report = _Report(submission)
        try:
            async for chunk in submission:
                report.add(chunk)
                if chunk.text:
                    yield chunk.text
        except (ModelLoadError, ValueError) as e:  # ValueError: a prompt too long for the context or the pool
            raise llm.ModelError(one_line(e)) from None
        report.record(response)
