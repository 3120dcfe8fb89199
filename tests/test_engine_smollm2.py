"""The engine on the real SmolLM2-135M-Instruct against mlx-lm's stream_generate."""

import json

import mlx.core as mx
import pytest
from mlx_lm.generate import stream_generate
from smollm2 import smollm2_dir

from llm_paged_mlx import Engine, EngineConfig, SamplingParams
from llm_paged_mlx.models.loading import load_model

QUESTIONS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "Write one sentence about cats.",
    "What is 12 times 12?",
    "Why is the sky blue? Answer briefly.",
    "Translate 'good morning' into Spanish.",
]
STORY = (
    "The lighthouse keeper climbed the spiral stairs every evening, counting each of the one hundred "
    "and twelve steps, while the sea below threw itself against the rocks. "
)


@pytest.fixture(scope="module")
def smollm2():
    return load_model(str(smollm2_dir()), dequantize=True, dtype="float32")


def chat(tokenizer, text):
    return tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)


def reference(model, tokenizer, prompt, max_tokens):
    tokens, text = [], ""
    for response in stream_generate(model, tokenizer, prompt, max_tokens=max_tokens):
        text += response.text
        if response.finish_reason != "stop":
            tokens.append(response.token)
    return tokens, text


def test_concurrent_requests_match_stream_generate(smollm2):
    model, tokenizer = smollm2
    long_text = STORY * 20 + "\nSummarize the story in one sentence."
    prompts = [[tokenizer.bos_token_id or 1]] + [chat(tokenizer, q) for q in QUESTIONS] + [chat(tokenizer, long_text)]
    prompts.append(chat(tokenizer, STORY * 6 + "\nWhat did the keeper count?"))
    assert len(prompts) >= 8 and len(prompts[0]) == 1 and max(len(p) for p in prompts) > 600
    # Not checked against mlx-lm at load (verify_model): this test compares every token with mlx-lm's, and the
    # check's verdict for this chunk size (a fingerprint of its own) would cost a check of its own, seconds on 2 cores.
    engine = Engine(model, tokenizer, block_size=16, num_blocks=48, max_num_batched_tokens=256, verify_model=False)
    params = SamplingParams(max_tokens=24)
    ids = [engine.add_request(p, params) for p in prompts[:4]]
    tokens, texts = {}, {}
    for _ in range(3):
        for chunk in engine.step():
            tokens.setdefault(chunk.request_id, []).extend(chunk.token_ids)
            texts[chunk.request_id] = texts.get(chunk.request_id, "") + chunk.text
    ids += [engine.add_request(p, params) for p in prompts[4:]]
    while engine.has_unfinished():
        for chunk in engine.step():
            tokens.setdefault(chunk.request_id, []).extend(chunk.token_ids)
            texts[chunk.request_id] = texts.get(chunk.request_id, "") + chunk.text
    assert engine.stats()["preemptions"] > 0
    assert engine.stats()["free_blocks"] == 47
    for rid, prompt in zip(ids, prompts):
        ref_tokens, ref_text = reference(model, tokenizer, prompt, 24)
        assert tokens.get(rid, []) == ref_tokens, f"prompt of {len(prompt)} tokens"
        assert texts.get(rid, "") == ref_text


def test_text_prompt_answer_and_stop_string(smollm2):
    model, tokenizer = smollm2
    engine = Engine(model, tokenizer, num_blocks=64)
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}], add_generation_prompt=True, tokenize=False
    )
    out = engine.generate([prompt], SamplingParams(max_tokens=32))[0]
    assert "Paris" in out.text
    assert out.finish_reason == "stop"
    ref_tokens, ref_text = reference(model, tokenizer, prompt, 32)
    assert out.token_ids == ref_tokens and out.text == ref_text
    cut = engine.generate([prompt], SamplingParams(max_tokens=32, stop=["Paris"]))[0]
    assert cut.text == out.text[: out.text.index("Paris")]
    assert cut.finish_reason == "stop"
    streamed = "".join(c.text for c in engine.stream(prompt, SamplingParams(max_tokens=32, stop=["Paris"])))
    assert streamed == cut.text
    assert engine.stats()["free_blocks"] == 63
    mx.clear_cache()


def test_prompt_lookup_matches_stream_generate_beside_a_schema_request(smollm2):
    """Speculative decoding (ngram) on a real model and a task that repeats its input: mlx-lm's tokens and
    text, a stop string inside an accepted draft, and a JSON-schema request whose drafts its grammar masks, in
    the same steps."""
    model, tokenizer = smollm2
    edit = chat(tokenizer, "Fix the spelling mistakes in this paragraph and write it out again in full:\n\n" + STORY)
    question = chat(tokenizer, QUESTIONS[4])
    schema = {"type": "object", "properties": {"text": {"type": "string", "maxLength": 160}}, "required": ["text"]}
    constrained = SamplingParams(max_tokens=70, json_schema=schema)
    ask = chat(tokenizer, 'Put this text into JSON, as the value of "text":\n\n' + STORY)
    engine = Engine(model, tokenizer, num_blocks=96, speculative="ngram")
    plain = Engine(model, tokenizer, num_blocks=96).generate([ask], constrained)[0]
    free = [engine.add_request(p, SamplingParams(max_tokens=40)) for p in (edit, question)]
    stopped = engine.add_request(edit, SamplingParams(max_tokens=40, stop=["steps"]))
    json_id = engine.add_request(ask, constrained)
    outputs = {}
    while engine.has_unfinished():
        for chunk in engine.step():
            out = outputs.setdefault(chunk.request_id, {"tokens": [], "text": ""})
            out["tokens"] += chunk.token_ids
            out["text"] += chunk.text
            out["drafted"] = chunk.drafted
    for rid, prompt in zip(free, (edit, question)):
        assert (outputs[rid]["tokens"], outputs[rid]["text"]) == reference(model, tokenizer, prompt, 40)
    whole = outputs[free[0]]["text"]
    assert "steps" in whole and outputs[stopped]["text"] == whole[: whole.index("steps")]
    assert outputs[json_id]["tokens"] == plain.token_ids and outputs[json_id]["drafted"].accepted > 0
    assert json.loads(outputs[json_id]["text"])["text"].startswith("The lighthouse keeper climbed")
    stats = engine.stats()
    assert stats["accepted_draft_tokens"] > 10 and stats["free_blocks"] == stats["num_blocks"]


def test_from_pretrained_loads_dequantized_on_cpu(smollm2):
    model, tokenizer = smollm2
    engine = Engine.from_pretrained(str(smollm2_dir()), num_blocks=64)
    assert not any("Quantized" in type(m).__name__ for _, m in engine.model.named_modules())
    prompt = chat(tokenizer, "What is the capital of France?")
    out = engine.generate([prompt], SamplingParams(max_tokens=16))[0]
    assert (out.token_ids, out.text) == reference(model, tokenizer, prompt, 16)
    with pytest.raises(ValueError, match="no config.json"):
        Engine.from_pretrained(str(smollm2_dir().parent))
    config = Engine.from_pretrained(str(smollm2_dir()), config=EngineConfig(block_size=32), verify_model=False).config
    assert (config.block_size, config.kv_budget_bytes) == (32, "auto")  # a given config without a budget: auto
