"""Chat messages into prompt tokens, through the model's own chat template."""


def render_prompt(tokenizer, messages: list[dict]) -> list[int]:
    """Token ids of the chat, through the tokenizer's chat template when it has one."""
    if tokenizer is None:
        raise ValueError("this model has no tokenizer, so it cannot take chat messages; send token ids as a prompt")
    if getattr(tokenizer, "chat_template", None):
        return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True))
    return tokenizer.encode("\n\n".join(m["content"] for m in messages))
