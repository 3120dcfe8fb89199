"""Hybrid models on the paged engine: each sequence's recurrent state kept beside its K/V blocks."""

import mlx.nn as nn
import pytest
from faults import Injector, run_through_faults
from models import tiny_any
from test_engine import random_prompts, reference, run_staggered

from llm_paged_mlx import Engine, SamplingParams
from llm_paged_mlx.models.state_cache import PagedStateCache

# A recurrent (gated delta, Mamba, short convolution) layer, then full attention, in each model's own words.
MODELS = {
    "qwen3_next": {},
    "qwen3_5": {},
    "qwen3_5_moe": {},
    "lfm2": dict(layer_types=["conv", "full_attention"]),
    "nemotron_h": dict(layer_types=["linear_attention", "full_attention"]),
    "granitemoehybrid": dict(layer_types=["mamba", "attention"]),
    "jamba": {},
    "falcon_h1": {},  # both in every layer: Mamba beside attention
}
LENGTHS = [1, 3, 31, 33, 70, 150, 250, 300]


def hybrid(arch="qwen3_5"):
    return tiny_any(arch, **MODELS[arch])


@pytest.mark.parametrize("arch", list(MODELS))
def test_greedy_tokens_match_mlx_lm_with_preemption(arch):
    """Eight requests of 1 to 300 tokens, 40 new tokens each, chunked prefills, in a pool that preempts."""
    model = hybrid(arch)
    prompts = random_prompts(LENGTHS, seed=8)
    engine = Engine(model, block_size=16, num_blocks=64, max_num_batched_tokens=64, max_num_seqs=8)
    assert engine.runner.kv.states
    got = run_staggered(engine, prompts, SamplingParams(max_tokens=40), first=6)
    for prompt, tokens in zip(prompts, got):
        assert tokens == reference(model, prompt, 40), f"prompt of {len(prompt)} tokens"
    stats = engine.stats()
    assert stats["preemptions"] > 0
    assert stats["free_blocks"] == 63
    assert stats["recurrent_states"] == 0


@pytest.mark.parametrize("policy", ["cpu", "disk", "recompute"])
def test_a_preempted_sequence_s_state_is_swapped_with_its_k_v_or_computed_again(policy):
    model = hybrid()
    prompts = random_prompts(LENGTHS, seed=4)
    engine = Engine(model, block_size=16, num_blocks=48, max_num_batched_tokens=64, swap_policy=policy)
    got = run_staggered(engine, prompts, SamplingParams(max_tokens=30), first=6)
    assert got == [reference(model, p, 30) for p in prompts]
    assert engine.stats()["preemptions"] > 0
    assert engine.stats()["recurrent_states"] == 0


def test_eager_steps_match_compiled_ones():
    model = hybrid("lfm2")
    prompts = random_prompts([5, 40, 90], seed=2)
    params = SamplingParams(max_tokens=20)
    compiled = Engine(model, num_blocks=32).generate(prompts, params)
    eager = Engine(model, num_blocks=32, compile_steps=False).generate(prompts, params)
    assert [o.token_ids for o in compiled] == [o.token_ids for o in eager] == [reference(model, p, 20) for p in prompts]


def test_prefix_caching_is_off_and_the_state_counts_in_the_budget():
    """A state is not kept per block: no prefix cache; the state of max_num_seqs sequences comes out of the
    budget."""
    model = hybrid()
    engine = Engine(model, block_size=16, kv_budget_bytes=8 * 1024**2, max_num_seqs=4)
    stats = engine.stats()
    per_sequence = sum(layout.bytes_per_sequence for layout in engine.runner.spec.states)
    assert stats["prefix_caching"] is False
    assert stats["recurrent_state_bytes"] == 4 * per_sequence
    assert engine.kv_budget_bytes <= 8 * 1024**2
    assert engine.max_blocks == (8 * 1024**2 - stats["recurrent_state_bytes"]) // engine.pool.block_bytes
    prompt = random_prompts([40], seed=3)[0]
    first, again = (engine.generate([prompt], SamplingParams(max_tokens=5))[0] for _ in range(2))
    assert again.num_cached_tokens == 0 and again.token_ids == first.token_ids == reference(model, prompt, 5)


def test_by_default_the_state_takes_at_most_half_the_budget():
    model = hybrid()
    per_sequence = sum(layout.bytes_per_sequence for layout in Engine(model, num_blocks=8).runner.spec.states)
    budget = 20 * per_sequence
    stats = Engine(model, kv_budget_bytes=budget).stats()
    assert stats["max_num_seqs"] == 10 and stats["recurrent_state_bytes"] == 10 * per_sequence
    assert Engine(model, kv_budget_bytes=budget, max_num_seqs=12).stats()["max_num_seqs"] == 12  # as asked


def test_a_budget_the_asked_sequences_states_fill_is_refused_with_the_reason():
    with pytest.raises(ValueError, match="recurrent state for 64 sequences .*lower max_num_seqs"):
        Engine(hybrid(), kv_budget_bytes=64 * 1024, max_num_seqs=64)


def test_many_decoding_sequences_beside_a_prompt_s_chunks():
    """Nine decode rows (a compiled call padded to ten) in the steps that also run prompts' chunks."""
    model = hybrid()
    prompts = random_prompts([5] * 9 + [20, 30, 45], seed=6)
    engine = Engine(model, block_size=16, num_blocks=128, max_num_batched_tokens=256, max_num_seqs=32)
    got = run_staggered(engine, prompts, SamplingParams(max_tokens=12), first=9)
    assert got == [reference(model, p, 12) for p in prompts]


class Untraceable(nn.Module):
    """A model's final norm that reads an array's value, which ``mx.compile`` cannot trace."""

    def __init__(self, norm):
        super().__init__()
        self.norm = norm

    def __call__(self, x):
        x.sum().item()
        return self.norm(x)


def test_a_hybrid_whose_steps_cannot_be_compiled_runs_them_eagerly():
    model = hybrid()
    model.language_model.model.norm = Untraceable(model.language_model.model.norm)
    prompts = random_prompts([5, 40], seed=7)
    with pytest.warns(RuntimeWarning, match="cannot be compiled"):
        outputs = Engine(model, num_blocks=32, verify_model=False).generate(prompts, SamplingParams(max_tokens=8))
    assert [o.token_ids for o in outputs] == [reference(model, p, 8) for p in prompts]


@pytest.mark.parametrize("failing, calls", [("keep", [3, 5]), ("__getitem__", [9, 40])])
def test_a_failed_step_is_undone_state_included(failing, calls, monkeypatch):
    """A step fails while a recurrent layer reads its state, or as what it wrote is kept: every sequence's
    state is as before the step, every request still gets mlx-lm's tokens and no state is left behind."""
    model = hybrid()
    prompts = random_prompts(LENGTHS, seed=5)
    expected = [reference(model, p, 30) for p in prompts]
    injector = Injector(monkeypatch, PagedStateCache, failing, calls)
    engine = Engine(model, block_size=16, num_blocks=48, max_num_batched_tokens=64, max_num_seqs=8)
    got = run_through_faults(engine, prompts, SamplingParams(max_tokens=30))
    assert injector.failures == 2
    assert got == expected
    assert engine.stats()["free_blocks"] == engine.stats()["num_blocks"]
    assert engine.stats()["recurrent_states"] == 0


@pytest.mark.parametrize("arch", ["mamba", "rwkv7"])
def test_models_without_attention_are_refused_with_the_reason(arch):
    with pytest.raises(ValueError, match=f"^{arch}: has no attention layers"):
        Engine(tiny_any(arch), num_blocks=16)
