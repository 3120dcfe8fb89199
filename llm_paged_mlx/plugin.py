"""The llm plugin: MLX models served by the paged engine, as ``llm -m paged-...``.

Every prompt, sync or async, goes to its model's engine loop (``engines``), so
concurrent prompts share the engine's steps. llm imports every plugin as it
starts (``llm --help`` too), so mlx and mlx-lm, seconds of imports, come at a
model's first prompt instead, where a Ctrl-C ends ``llm`` with ``Aborted!``.
"""

import math
import sys
import time
from typing import Callable

import llm
from llm.parts import TextPart, ToolCallPart, ToolResultPart

from .catalog import builtin_models, registered_models
from .engine.loop import StepFailed, Submission
from .engines import ModelLoadError, engine_loop
from .errors import one_line
from .options import PagedOptions, sampling_params, serving_config


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
    """The whole chain llm hands over (system, earlier turns, this turn) as chat messages, in the form chat
    templates take: an assistant turn's tool calls in ``tool_calls``, each tool result a ``"tool"`` message."""
    messages = []
    for message in prompt.messages:
        text = "".join(part.text for part in message.parts if isinstance(part, TextPart))
        calls = [part for part in message.parts if isinstance(part, ToolCallPart)]
        results = [part for part in message.parts if isinstance(part, ToolResultPart)]
        for result in results:
            output = result.output if result.exception is None else f"Error: {result.exception}"
            call_id = result.tool_call_id
            messages.append({"role": "tool", "content": output, "name": result.name, "tool_call_id": call_id})
        if text or calls or not results:
            messages.append({"role": message.role, "content": text})
        if calls:
            messages[-1]["tool_calls"] = [
                {"id": c.tool_call_id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                for c in calls
            ]
    return messages


def tool_specs(prompt: llm.Prompt) -> list[dict]:
    """The prompt's tools as the function specs chat templates take."""
    return [
        {
            "type": "function",
            "function": {"name": t.name, "description": t.description or "", "parameters": t.input_schema},
        }
        for t in prompt.tools
    ]


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
        if final.drafted:  # speculative decoding drafted for it
            response.response_json.update(final.drafted.as_dict())


class _PagedBase:
    can_stream = True
    supports_tools = True
    supports_schema = True

    class Options(PagedOptions, llm.Options):
        """This plugin's options on llm's base."""

    def __init__(self, model_id: str, source: str, fetch: Callable[[], str]):
        self.model_id = model_id
        self.source = source
        self.fetch = fetch

    def _submit(self, prompt) -> Submission:
        from .chat import render_prompt

        try:
            params = sampling_params(prompt.options, prompt.schema)
            config = serving_config(prompt.options)
        except ValueError as e:
            raise llm.ModelError(one_line(e)) from None
        messages, tools = chat_messages(prompt), tool_specs(prompt)
        loop = engine_loop(self.model_id, self.source, self.fetch, tensor_parallel=prompt.options.tensor_parallel or 1)
        render = lambda tokenizer: render_prompt(tokenizer, messages, tools)  # noqa: E731
        return loop.submit(render, params, config)


class _Answer:
    """A response's text and tool calls from its chunks (calls only with tools: otherwise all is text)."""

    def __init__(self, submission: Submission, prompt):
        self.submission = submission
        self.tools = tool_specs(prompt)
        self.reader = None

    def text(self, chunk) -> str:
        """The text of a chunk that the user sees."""
        if not self.tools:
            return chunk.text or ""
        if self.reader is None:  # the tokenizer is known once the request is admitted, before its first chunk
            from .tool_calls import ToolCallReader

            self.reader = ToolCallReader(self.submission.tokenizer, self.tools)
        text = self.reader.feed(chunk.text or "")
        return text + self.reader.finish() if chunk.finish_reason else text

    def record_calls(self, response) -> None:
        for call in self.reader.calls if self.reader else []:
            response.add_tool_call(llm.ToolCall(name=call.name, arguments=call.arguments, tool_call_id=call.id))


class PagedModel(_PagedBase, llm.Model):
    def execute(self, prompt, stream, response, conversation):
        submission = self._submit(prompt)
        report, answer = _Report(submission), _Answer(submission, prompt)
        try:
            for chunk in submission:
                report.add(chunk)
                if text := answer.text(chunk):
                    yield text
        except (ModelLoadError, StepFailed, ValueError) as e:  # ValueError: a prompt too long for the context or pool
            raise llm.ModelError(one_line(e)) from None
        answer.record_calls(response)
        report.record(response)


class AsyncPagedModel(_PagedBase, llm.AsyncModel):
    async def execute(self, prompt, stream, response, conversation):
        submission = self._submit(prompt)
        report, answer = _Report(submission), _Answer(submission, prompt)
        try:
            async for chunk in submission:
                report.add(chunk)
                if text := answer.text(chunk):
                    yield text
        except (ModelLoadError, StepFailed, ValueError) as e:  # ValueError: a prompt too long for the context or pool
            raise llm.ModelError(one_line(e)) from None
        answer.record_calls(response)
        report.record(response)
