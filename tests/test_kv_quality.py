"""Quantized K/V on the real SmolLM2: the engine loses no more than mlx-lm's QuantizedKVCache.

The measurements are ``benchmarks/kv_quality.py``'s: what a user sees, greedy answers to chat prompts
against full precision's (the index of the first token that differs); and, on a shorter text than the
benchmark's (384 tokens fed in chunks of 128), each position's next-token distribution compared (KL)
with the same system at full precision. mlx-lm's quantized attention is slow on the CPU (about half
of this module's time), hence the lengths; and since a quantized answer's tokens after its first difference
do not change that index, they are generated only up to it (mlx-lm's at 4 bits: a quarter of the tokens).
"""

import sys
from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step
from smollm2 import smollm2_dir

from llm_paged_mlx import Engine, SamplingParams
from llm_paged_mlx.models.loading import ModelFetchError, load_model

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from kv_quality import (  # noqa: E402
    BATCH, BITS, CHAT_QUESTIONS, GROUP_SIZE, chat_prompts, engine_answers, first_difference, measure_quality,
    mlx_lm_answers, text_tokens,
)  # fmt: skip

NEW_TOKENS, PROMPTS = 48, 8  # the benchmark's first 8 prompts: its table has all of them



@pytest.fixture(scope="module")
def smollm2():
    try:
        path = smollm2_dir()
    except ModelFetchError as e:
        pytest.skip(f"SmolLM2 is not cached and cannot be fetched: {e}")
    return load_model(str(path), dequantize=True, dtype="float32")


@pytest.fixture(scope="module")
def quality(smollm2):
    model, tokenizer = smollm2
    tokens, _ = text_tokens(tokenizer, 384)
    return measure_quality(model, tokens, chunk=128, bits=BITS)


def mlx_lm_first_differences(model, prompts, references, kv_bits) -> list[int]:
    """``kv_quality.mlx_lm_answers(model, prompts, NEW_TOKENS, kv_bits)`` (the same ``generate_step`` settings),
    each answer as the index of its first token that differs from its reference (NEW_TOKENS if none does):
    ``first_difference`` of the whole answer, but without generating the tokens after that one."""
    quant = {"kv_bits": kv_bits, "kv_group_size": GROUP_SIZE, "quantized_kv_start": 0}
    greedy = lambda logprobs: mx.argmax(logprobs, axis=-1)  # noqa: E731
    firsts = []
    for prompt, reference in zip(prompts, references):
        assert len(reference) == NEW_TOKENS
        steps = generate_step(mx.array(prompt), model, max_tokens=NEW_TOKENS, sampler=greedy, **quant)
        firsts.append(next((i for i, (token, _) in enumerate(steps) if int(token) != reference[i]), NEW_TOKENS))
        steps.close()
    return firsts


def engine_first_differences(model, tokenizer, prompts, references, kv_bits) -> list[int]:
    """``kv_quality.engine_answers(model, tokenizer, prompts, NEW_TOKENS, kv_bits)`` (its engine, BATCH prompts at
    a time), each answer as the index of its first token that differs from its reference: a batch stops once each
    of its answers has differed, its steps until then those of the whole run."""
    engine = Engine(model, tokenizer, kv_budget_bytes=256 << 20, verify_model=False, kv_bits=kv_bits,
                    kv_group_size=GROUP_SIZE)  # fmt: skip
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    firsts = []
    for start in range(0, len(prompts), BATCH):
        ids = [engine.add_request(prompt, params) for prompt in prompts[start : start + BATCH]]
        expected = dict(zip(ids, references[start : start + BATCH]))
        tokens = {rid: [] for rid in ids}
        differed = lambda rid: first_difference(tokens[rid], expected[rid]) < len(tokens[rid])  # noqa: E731
        while engine.has_unfinished() and not all(differed(rid) for rid in ids):
            for chunk in engine.step():
                tokens[chunk.request_id] += chunk.token_ids
        for rid in ids:
            engine.abort(rid)
        firsts += [first_difference(tokens[rid], expected[rid]) for rid in ids]
    return firsts


@pytest.fixture(scope="module")
def agreement(smollm2):
    """``kv_quality.measure_agreement`` over the first PROMPTS chat prompts, NEW_TOKENS tokens each (the same
    result: quantized answers stop at their first difference, which is all the result keeps of them)."""
    model, tokenizer = smollm2
    prompts = chat_prompts(tokenizer, CHAT_QUESTIONS[:PROMPTS])
    full = {
        "mlx-lm": mlx_lm_answers(model, prompts, NEW_TOKENS),
        "engine": engine_answers(model, tokenizer, prompts, NEW_TOKENS),
    }
    result = {("engine", None): [first_difference(a, b) for a, b in zip(full["engine"], full["mlx-lm"])]}
    for bits in BITS:
        result["engine", bits] = engine_first_differences(model, tokenizer, prompts, full["engine"], bits)
        result["mlx-lm", bits] = mlx_lm_first_differences(model, prompts, full["mlx-lm"], bits)
    return result


def test_full_precision_answers_are_mlx_lm_s(agreement):
    assert agreement["engine", None] == [NEW_TOKENS] * len(agreement["engine", None])


@pytest.mark.parametrize("prompts", [4, PROMPTS])
@pytest.mark.parametrize("bits", BITS)
def test_quantized_answers_stay_with_full_precision_as_long_as_mlx_lm_s(bits, prompts, agreement):
    """The mean index of the first token that differs from full precision's answer, over the first 4 prompts
    (issue Q's) and over all of them."""
    ours, theirs = agreement["engine", bits][:prompts], agreement["mlx-lm", bits][:prompts]
    assert sum(ours) >= sum(theirs), f"{bits}-bit: engine {ours}, mlx-lm {theirs}"


def mean_kl(quality, system, bits):
    return float(quality[system, bits]["kl"].mean())


def test_full_precision_pools_give_mlx_lm_logits(quality):
    assert quality["full_max_abs_diff"] < 1e-3


@pytest.mark.parametrize("bits", BITS)
def test_quantized_pools_lose_no_more_than_mlx_lm(quality, bits):
    ours, theirs = mean_kl(quality, "engine", bits), mean_kl(quality, "mlx-lm", bits)
    # The engine's chunks attend to their own K/V before quantization and its keys are stored rotated, so
    # its KL is a fraction of mlx-lm's (benchmarks/RESULTS.md); the bound is the 1.1x, and the
    # absolute term covers rounding noise at 8 bits, where the KL itself is small.
    assert ours <= 1.1 * theirs + 1e-4, f"{bits}-bit: engine KL {ours:.3e}, mlx-lm {theirs:.3e}"


def test_fewer_bits_lose_more_and_quantization_is_applied(quality):
    kl8, kl4 = mean_kl(quality, "engine", 8), mean_kl(quality, "engine", 4)
    # Pools that silently kept full precision would give a KL of 0 (or rounding noise far below 1e-5).
    assert kl4 > kl8 > 1e-5, f"engine KL: 8-bit {kl8:.3e}, 4-bit {kl4:.3e}"
    assert mean_kl(quality, "mlx-lm", 4) > mean_kl(quality, "mlx-lm", 8) > 1e-5
