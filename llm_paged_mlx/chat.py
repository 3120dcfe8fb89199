"""Chat messages into prompt tokens, through the model's own chat template."""

from .tool_calls import check_tools


def render_prompt(tokenizer, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
    """Token ids of the chat, through the tokenizer's chat template when it has one.

    ``messages`` are OpenAI-style chat messages (assistant turns may carry
    ``tool_calls`` with arguments as dicts; tool results are ``"tool"``
    messages); ``tools`` are OpenAI-style function specs, which only a template
    with a tool-call format takes (``tool_calls.NoToolCalling`` otherwise).
    """
    if tokenizer is None:
        raise ValueError("this model has no tokenizer, so it cannot take chat messages; send token ids as a prompt")
    check_tools(tokenizer, tools)
    if getattr(tokenizer, "chat_template", None):
        return list(tokenizer.apply_chat_template(messages, tools=tools or None, add_generation_prompt=True))
    return tokenizer.encode("\n\n".join(m.get("content") or "" for m in messages))
