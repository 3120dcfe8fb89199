"""A request's prompt and sampling fields as the engine takes them, checked first."""

import json
from typing import Optional

from ..engine.engine import encode_text
from ..engine.request import SamplingParams
from ..errors import one_line
from .errors import APIError
from .schemas import SamplingFields


def sampling_params(served, body: SamplingFields, max_tokens: Optional[int], logprobs: Optional[int],
                    continues_prompt: bool = False, json_schema: Optional[dict] = None) -> SamplingParams:  # fmt: skip
    """The request's ``SamplingParams``: its fields over the ``served`` model's defaults."""
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


def chat_message(message, index: int) -> dict:
    """A request's chat message as chat templates take it."""
    out = {"role": message.role, "content": checked_text(message.text(), f"messages.{index}.content")}
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


def document(tokenizer, text: str):
    """A completion's prompt ``text`` as token ids; an empty one starts a new document, as OpenAI's does: the
    tokenizer's BOS if it adds one, else its EOS token, which ends a document."""
    if tokenizer is None:
        return text  # the engine refuses text without a tokenizer
    return encode_text(tokenizer, text) or [tokenizer.eos_token_id]


def bias_checked(prompt, bias: dict[int, float]):
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


def checked_text(text: str, param: str) -> str:
    """``text``, if it is valid Unicode (JSON can carry a lone surrogate, which no tokenizer encodes)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise APIError(400, f"{param} holds a lone surrogate (\\u{ord(text[e.start]):04x}), which is not text",
                       param=param) from None
    return text
