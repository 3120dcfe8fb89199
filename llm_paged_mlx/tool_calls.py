"""Tool calls in generated text, in the model's own chat format.

mlx-lm knows, from a model's chat template, the markers that open and close a
tool call and the parser for what lies between (``mlx_lm/tool_parsers``);
``ToolCallReader`` uses both to split a stream of generated text into the text
a user sees and the calls the model made.
"""

import json
from dataclasses import dataclass

from mlx_lm.generate import TextStateMachine


class NoToolCalling(ValueError):
    """Tools were given for a model whose chat template has no tool-call format mlx-lm knows."""


@dataclass
class ToolCall:
    name: str
    arguments: dict
    id: str | None = None  # the model's own id for the call, where its format has one


def check_tools(tokenizer, tools) -> None:
    """Raise ``NoToolCalling`` if ``tools`` are given and the model cannot call them."""
    if tools and not getattr(tokenizer, "has_tool_calling", False):
        raise NoToolCalling(
            "the model's chat template has no tool-call format that mlx-lm knows, so it cannot call tools"
        )


class ToolCallReader:
    """Splits generated text into what a user sees and the model's tool calls.

    ``feed`` takes each piece of text as it is generated and returns the part
    of it that is plain text (the text of a call is held back, and so is text
    that may be the start of a marker); ``finish`` returns what is left. A call
    that does not parse (cut off by the token limit, or malformed) is given
    back as plain text, markers included, so nothing the model wrote is lost.
    """

    def __init__(self, tokenizer, tools: list[dict] | None = None):
        self.start, self.end = tokenizer.tool_call_start, tokenizer.tool_call_end
        self.parser = tokenizer.tool_parser
        self.tools = tools
        transitions = {"normal": [(self.start, "tool")], "tool": [(self.end, "normal")] if self.end else []}
        self._state = TextStateMachine(transitions).make_state("normal")
        self._call: str | None = None  # the text of the call being read, if one is open
        self.calls: list[ToolCall] = []

    def feed(self, text: str) -> str:
        self._state, segments = TextStateMachine.split(self._state, text)
        return self._take(segments)

    def finish(self) -> str:
        """The text still held back; a call left open (a format without an end marker, or cut off) ends here."""
        self._state, rest, state = TextStateMachine.flush(self._state)
        visible = self._take([(state, rest)])
        return visible + (self._close(ended=False) if self._call is not None else "")

    def _take(self, segments) -> str:
        visible = ""
        for state, text in segments:
            if state == "tool":
                self._call = (self._call or "") + text
                continue
            if self._call is not None:  # the end marker closed the call
                visible += self._close(ended=True)
            visible += text
        return visible

    def _close(self, ended: bool) -> str:
        """Parse the call just read; its text if it does not parse."""
        text, self._call = self._call, None
        try:
            parsed = self.parser(text, self.tools)
            calls = [to_call(c) for c in (parsed if isinstance(parsed, list) else [parsed])]
        except Exception:  # the parsers raise what their parsing hits (RecursionError for deep JSON, ...)
            return self.start + text + (self.end if ended else "")
        self.calls += calls
        return ""


def to_call(parsed: dict) -> ToolCall:
    """A parser's ``{"name", "arguments"[, "id"]}`` as a ``ToolCall``; arguments given as JSON text are read."""
    name, arguments = parsed["name"], parsed.get("arguments", {})
    if isinstance(arguments, str):
        arguments = json.loads(arguments)
    if not isinstance(name, str) or not isinstance(arguments, dict):
        raise ValueError(f"not a tool call: {parsed!r}")
    return ToolCall(name, arguments, parsed.get("id"))
