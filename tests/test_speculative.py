"""Speculative decoding by prompt lookup: exact tokens (against mlx-lm and the engine without it), the target's
distribution when sampled, drafts given back without leaks, refusals."""

import math
import random

import mlx.core as mx
import numpy as np
import pytest
from models import tiny_any, tiny_model
from test_engine import random_prompts, reference, run_staggered

from llm_paged_mlx import Engine, SamplingParams
from llm_paged_mlx.engine import speculative
from llm_paged_mlx.engine.speculative import accepted, lookup
from llm_paged_mlx.engine.step import StepPipeline


def repeating_prompts(count, seed=3, vocab=256):
    """Prompts that repeat a phrase of their own, as an edit of a given text does: prompt lookup finds drafts."""
    rng = random.Random(seed)
    prompts = []
    for i in range(count):
        phrase = [rng.randrange(vocab) for _ in range(rng.randrange(3, 12))]
        prompts.append([rng.randrange(vocab) for _ in range(i % 5)] + phrase * rng.randrange(2, 6))
    return prompts


def test_lookup_proposes_what_followed_the_longest_recurring_ngram():
    def proposed(tokens, k):
        return lookup(np.array(tokens), k)

    tokens = [7, 1, 2, 3, 9, 1, 2, 4, 5, 2, 3, 1, 2]
    # The last 3-gram (3, 1, 2) never came before; the last 2-gram (1, 2) came at 1 and 5.
    assert proposed(tokens, 2) == [4, 5]  # the latest occurrence with k tokens after it
    assert proposed(tokens, 7) == [3, 9, 1, 2, 4, 5, 2]  # none has 7 after it: the earliest
    assert proposed([1, 2, 3, 4], 3) == []  # nothing recurs
    assert proposed([5], 3) == []
    assert proposed([9, 5, 5, 5, 5, 5, 5], 4) == [5, 5, 5]  # a run drafts as much as it can
    far = [1000 + i for i in range(5000)] + list(range(20)) + [1000, 1001, 1002]
    assert proposed(far, 3) == [1003, 1004, 1005]  # 5,000 tokens back


def test_accepted_keeps_the_draft_while_samples_agree():
    assert accepted([5, 6, 7], [5, 6, 7, 8]) == [5, 6, 7, 8]  # all drafted, plus the token after them
    assert accepted([5, 6, 7], [5, 9, 7, 8]) == [5, 9]  # the first disagreeing sample ends it
    assert accepted([5, 6, 7], [1, 6, 7, 8]) == [1]


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_greedy_tokens_match_mlx_lm_with_drafts_preemption_and_prefix_caching(arch):
    model = tiny_model(arch)
    prompts = repeating_prompts(10) + random_prompts([17, 40])
    prompts.append(prompts[0] + [3, 4])  # shares a cached prefix with the first
    engine = Engine(model, block_size=8, num_blocks=48, max_num_batched_tokens=64, speculative="ngram",
                    num_speculative_tokens=4, speculative_max_batch=16)  # fmt: skip
    got = run_staggered(engine, prompts, SamplingParams(max_tokens=30))
    for prompt, tokens in zip(prompts, got):
        assert tokens == reference(model, prompt, 30), f"prompt of {len(prompt)} tokens"
    stats = engine.stats()
    assert stats["preemptions"] > 0 and stats["prefix_cache_hit_tokens"] > 0
    assert stats["accepted_draft_tokens"] > 0 and stats["draft_tokens"] > stats["accepted_draft_tokens"]
    assert stats["free_blocks"] == stats["num_blocks"]  # rejected drafts' blocks all came back


def test_drafts_stop_where_decoding_stops(decode_launch):
    """A stop token or the length limit inside an accepted draft ends the request there; logprobs follow."""
    model = tiny_model("llama")
    prompts = repeating_prompts(8, seed=5)
    plain = Engine(model, block_size=8, num_blocks=128)
    spec = Engine(model, block_size=8, num_blocks=128, speculative="ngram", num_speculative_tokens=5,
                  speculative_max_batch=8)  # fmt: skip
    first = plain.generate(prompts, SamplingParams(max_tokens=20))
    stops = [out.token_ids[len(out.token_ids) // 2] for out in first]  # tokens each answer reaches
    params = [
        SamplingParams(max_tokens=n, stop_token_ids=[stop] if i % 2 else None, logprobs=2)
        for i, (n, stop) in enumerate(zip(range(7, 20), stops))
    ]
    want, got = plain.generate(prompts, params), spec.generate(prompts, params)
    for w, g in zip(want, got):
        assert (g.token_ids, g.finish_reason) == (w.token_ids, w.finish_reason)
        assert [lp.token_id for lp in g.logprobs or []] == g.token_ids
        for a, b in zip(w.logprobs or [], g.logprobs or []):
            assert math.isclose(a.logprob, b.logprob, abs_tol=1e-3)  # a GPU rounds float32 products by their rows
            assert [t for t, _ in a.top] == [t for t, _ in b.top]
    assert spec.stats()["accepted_draft_tokens"] > 0
    assert {w.finish_reason for w in want} == {"stop", "length"}


def test_seeded_sampling_gives_the_tokens_of_decoding():
    model = tiny_model("qwen3", vocab_size=12)  # few tokens: a sampled token often is the drafted one
    prompts = repeating_prompts(6, seed=7, vocab=12)
    params = [SamplingParams(max_tokens=24, temperature=0.7, top_p=0.95, seed=i) for i in range(6)]
    want = Engine(model, num_blocks=128).generate(prompts, params)
    spec = Engine(model, num_blocks=128, speculative="ngram", num_speculative_tokens=3, speculative_max_batch=8)
    got = spec.generate(prompts, params)
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    assert spec.stats()["accepted_draft_tokens"] > 0


def exact_distribution(model, prompt, position, vocab):
    """The model's distribution of the token at ``position`` of its sampled continuation (temperature 1)."""
    paths = {(): 1.0}
    for _ in range(position + 1):
        grown = {}
        for path, p in paths.items():
            logits = model(mx.array([prompt + list(path)]))[0, -1].astype(mx.float32)
            probs = mx.softmax(logits).tolist()
            for token in range(vocab):
                grown[path + (token,)] = p * probs[token]
        paths = grown
    marginal = [0.0] * vocab
    for path, p in paths.items():
        marginal[path[-1]] += p
    return marginal


def test_sampled_tokens_follow_the_models_distribution():
    """Chi-square of the third sampled token over many unseeded requests whose drafts the step verifies: a
    verifier that kept drafts too often (or too rarely) shifts it from the model's own distribution."""
    vocab, draws, position = 6, 900, 2
    model = tiny_model("llama", vocab_size=vocab, seed=2)
    prompt = [1, 2, 3, 1, 2, 3, 1, 2]
    expected = exact_distribution(model, prompt, position, vocab)
    mx.random.seed(11)
    engine = Engine(model, num_blocks=512, speculative="ngram", num_speculative_tokens=3, speculative_max_batch=64)
    outputs = engine.generate([prompt] * draws, SamplingParams(max_tokens=position + 1, temperature=1.0))
    counts = [0] * vocab
    for out in outputs:
        counts[out.token_ids[position]] += 1
    statistic = sum((c - draws * p) ** 2 / (draws * p) for c, p in zip(counts, expected))
    # 5 degrees of freedom: P(chi2 > 20.5) = 0.001
    assert statistic < 20.5, (counts, [round(draws * p, 1) for p in expected])
    stats = engine.stats()
    assert stats["accepted_draft_tokens"] > 0 and stats["draft_tokens"] > stats["accepted_draft_tokens"]


def test_aborts_and_finishes_amid_drafts_leave_no_blocks_behind():
    model = tiny_model("llama")
    engine = Engine(model, block_size=4, num_blocks=96, speculative="ngram", num_speculative_tokens=6,
                    speculative_max_batch=8)  # fmt: skip
    ids = [engine.add_request(p, SamplingParams(max_tokens=40)) for p in repeating_prompts(6, seed=9)]
    for _ in range(6):
        engine.step()
    engine.abort(ids[0])
    engine.abort(ids[3])
    while engine.has_unfinished():
        engine.step()
    stats = engine.stats()
    assert stats["free_blocks"] == stats["num_blocks"]
    assert stats["accepted_draft_tokens"] > 0


def count_run_ahead(monkeypatch) -> list:
    """A list that grows by one at each step built ahead (``StepPipeline.run_ahead``)."""
    ran_ahead = []
    run_ahead = StepPipeline.run_ahead
    monkeypatch.setattr(StepPipeline, "run_ahead", lambda self, step: ran_ahead.append(1) or run_ahead(self, step))
    return ran_ahead


def test_drafts_pause_where_they_miss_and_decoding_runs_ahead(monkeypatch):
    """A request whose drafts keep missing stops drafting for a while, so steps run ahead again."""
    model = tiny_model("llama")
    prompt = random_prompts([12], seed=4)[0]
    engine = Engine(model, num_blocks=64, speculative="ngram", num_speculative_tokens=2)
    want = reference(model, prompt, 40)
    wrong = next(t for t in range(256) if t not in want)
    monkeypatch.setattr(speculative, "lookup", lambda tokens, k: [wrong] * k)  # never what the model says
    ran_ahead = count_run_ahead(monkeypatch)
    out = engine.generate([prompt], SamplingParams(max_tokens=40))[0]
    assert out.token_ids == want
    stats = engine.stats()
    assert stats["accepted_draft_tokens"] == 0 < stats["draft_tokens"]
    # Drafting stops for PAUSE_TOKENS tokens after MAX_MISSES misses in a row: those tokens' steps run ahead.
    assert stats["drafts"] <= 2 * speculative.MAX_MISSES + 1
    assert len(ran_ahead) >= speculative.PAUSE_TOKENS


def test_large_batches_do_not_draft():
    model = tiny_model("llama")
    for limit, drafts in [(5, False), (6, True)]:  # six running
        engine = Engine(model, num_blocks=256, speculative="ngram", speculative_max_batch=limit)
        engine.generate(repeating_prompts(6), SamplingParams(max_tokens=8))
        assert (engine.stats()["draft_tokens"] > 0) == drafts


@pytest.mark.parametrize(
    "options, message",
    [
        (dict(speculative="medusa"), "unknown speculative mode 'medusa'"),
        (dict(speculative=""), "unknown speculative mode ''"),
        (dict(speculative="ngram", num_speculative_tokens=0), "num_speculative_tokens must be an integer from 1 to 16"),
        (dict(num_speculative_tokens=17), "num_speculative_tokens must be an integer from 1 to 16"),
        (dict(num_speculative_tokens=True), "num_speculative_tokens must be an integer"),
        (dict(speculative_max_batch=0), "speculative_max_batch must be a positive integer"),
        (dict(speculative="ngram", kv_bits=8), "speculative decoding with kv_bits"),
    ],
)
def test_bad_speculative_options_are_refused(options, message):
    with pytest.raises(ValueError, match=message):
        Engine(tiny_model("llama"), num_blocks=64, **options)


def test_recurrent_models_refuse_speculation():
    with pytest.raises(ValueError, match="cannot take back the recurrent state"):
        Engine(tiny_any("qwen3_5"), num_blocks=64, speculative="ngram")


def steps_and_tokens(engine, prompts, params):
    """Run the prompts to the end one step at a time: the steps taken, each request's tokens per step."""
    ids = [engine.add_request(p, params) for p in prompts]
    per_step = []
    while engine.has_unfinished():
        got = {rid: 0 for rid in ids}
        for chunk in engine.step():
            got[chunk.request_id] += len(chunk.token_ids)
        per_step.append([got[rid] for rid in ids])
    return per_step


def test_drafts_take_only_the_budget_and_blocks_other_requests_leave(monkeypatch):
    """A draft never takes a step's token budget or a block from another request: no step is lost to it and no
    request is preempted for it."""
    model = tiny_model("llama")
    params = SamplingParams(max_tokens=30)
    tight = dict(num_blocks=64, block_size=8, max_num_batched_tokens=2)  # one token each for two requests
    prompts = [[1, 2, 3] * 3, [100, 101]]
    plain = steps_and_tokens(Engine(model, **tight), prompts, params)
    drafted = steps_and_tokens(Engine(model, **tight, speculative="ngram"), prompts, params)
    assert drafted == plain  # each request gets its token at every step, as without drafts
    monkeypatch.setattr(speculative, "lookup", lambda tokens, k: [7] * k)  # a draft at every chance
    few = dict(num_blocks=9, block_size=4)  # 8 blocks: the two prompts and their next tokens, no room for drafts
    prompts = [[100 + i for i in range(15)], [150 + i for i in range(12)]]
    engine = Engine(model, **few, speculative="ngram", num_speculative_tokens=4)
    outputs = engine.generate(prompts, [SamplingParams(max_tokens=3), SamplingParams(max_tokens=2)])
    assert [o.token_ids for o in outputs] == [reference(model, p, n) for p, n in zip(prompts, (3, 2))]
    assert engine.stats()["preemptions"] == 0


def test_requests_that_find_no_draft_run_ahead(monkeypatch):
    model = tiny_model("llama")
    ran_ahead = count_run_ahead(monkeypatch)
    monkeypatch.setattr(speculative, "lookup", lambda tokens, k: [])
    engine = Engine(model, num_blocks=32, block_size=4, speculative="ngram")
    engine.generate([[1, 2, 3, 4, 5] * 4], SamplingParams(max_tokens=40))
    # MAX_MISSES chances without a draft pause drafting for PAUSE_TOKENS tokens: those steps run ahead.
    assert len(ran_ahead) >= 40 - 3 * speculative.MAX_MISSES - 1


# -- a draft model -------------------------------------------------------------------------------------


@pytest.mark.parametrize("draft_seed, all_accepted", [(0, True), (5, False)])  # the model itself; another
def test_a_draft_model_gives_mlx_lm_tokens_under_preemption_and_prefix_caching(decode_launch, draft_seed,
                                                                                all_accepted):
    model = tiny_model("llama")
    prompts = repeating_prompts(6) + random_prompts([17, 40])
    prompts.append(prompts[0] + [3, 4])  # shares a cached prefix with the first
    engine = Engine(model, block_size=8, num_blocks=40, max_num_batched_tokens=64, swap_policy="cpu",
                    draft_model=tiny_model("llama", seed=draft_seed), speculative_max_batch=16)  # fmt: skip
    got = run_staggered(engine, prompts, SamplingParams(max_tokens=30))
    for prompt, tokens in zip(prompts, got):
        assert tokens == reference(model, prompt, 30), f"prompt of {len(prompt)} tokens"
    stats = engine.stats()
    assert stats["speculative"] == "draft" and stats["preemptions"] > 0 and stats["prefix_cache_hit_tokens"] > 0
    assert stats["accepted_draft_tokens"] > 0
    assert (stats["accepted_draft_tokens"] == stats["draft_tokens"]) == all_accepted
    assert stats["free_blocks"] == stats["num_blocks"]


def test_a_draft_model_keeps_seeded_samples():
    model = tiny_model("qwen3", vocab_size=12)
    prompts = repeating_prompts(4, seed=7, vocab=12)
    params = [SamplingParams(max_tokens=24, temperature=0.7, seed=i) for i in range(4)]
    want = Engine(model, num_blocks=128).generate(prompts, params)
    spec = Engine(model, num_blocks=128, draft_model=tiny_model("qwen3", vocab_size=12))  # drafts its greedy tokens
    assert [g.token_ids for g in spec.generate(prompts, params)] == [w.token_ids for w in want]
    assert spec.stats()["accepted_draft_tokens"] > 0


@pytest.mark.parametrize(
    "target, draft, message",
    [
        (dict(arch="llama"), dict(arch="llama", vocab_size=128), "its vocabulary \\(128 tokens\\) is not the model's"),
        (dict(arch="gemma3_text"), dict(arch="llama"), "sliding-window or latent attention"),
        (dict(arch="llama"), dict(arch="qwen3_5"), "a draft model needs full attention in every layer"),
    ],
)
def test_draft_models_that_cannot_draft_are_refused(target, draft, message):
    def build(arch, **overrides):
        return tiny_model(arch, **overrides) if arch == "llama" else tiny_any(arch, **overrides)

    with pytest.raises(ValueError, match=message):
        Engine(build(**target), num_blocks=64, draft_model=build(**draft))


def test_draft_model_options_go_together():
    model = tiny_model("llama")
    with pytest.raises(ValueError, match="a draft model goes with speculative='draft'"):
        Engine(model, num_blocks=64, speculative="ngram", draft_model=tiny_model("llama"))
    with pytest.raises(ValueError, match="a draft model goes with speculative='draft'"):
        Engine(model, num_blocks=64, speculative="draft")


def test_a_draft_model_drafts_beside_a_prompt_that_runs_first_and_without_compiled_steps():
    """A drafting request after a higher-priority request's prompt chunk in one step (the draft model's call
    takes single tokens first), and steps run eagerly: the model drafting for itself, every draft is kept."""
    model = tiny_model("llama")
    engine = Engine(model, draft_model=tiny_model("llama"), block_size=8, num_blocks=64, max_num_batched_tokens=16,
                    scheduler="priority")  # fmt: skip
    prompts = [list(range(1, 11)), list(range(30, 50))]
    ids, outputs = [engine.add_request(prompts[0], SamplingParams(max_tokens=20))], {}
    for step in range(60):
        if step == 3:  # the first decodes, and drafts
            ids.append(engine.add_request(prompts[1], SamplingParams(max_tokens=20, priority=-1)))
        for chunk in engine.step():
            outputs.setdefault(chunk.request_id, []).extend(chunk.token_ids)
    assert [outputs[i] for i in ids] == [reference(model, p, 20) for p in prompts]
    eager = Engine(model, draft_model=tiny_model("llama"), num_blocks=64, compile_steps=False)
    prompts = repeating_prompts(3)
    assert [o.token_ids for o in eager.generate(prompts, SamplingParams(max_tokens=20))] == [
        reference(model, p, 20) for p in prompts
    ]
    for stats in (engine.stats(), eager.stats()):
        assert stats["accepted_draft_tokens"] == stats["draft_tokens"] > 0


def test_a_draft_model_runs_only_when_a_request_drafts_and_catches_up_in_chunks():
    """More requests than ``speculative_max_batch``: the draft model is not called at all; when one request is
    left it drafts after computing its K/V for every position it missed (prompt and answer so far, in calls
    of at most ``max_num_batched_tokens``). The model drafting for itself, every draft is kept only if that
    K/V is right."""
    model = tiny_model("llama")
    engine = Engine(model, draft_model=model, speculative_max_batch=2, block_size=8, num_blocks=96,
                    max_num_batched_tokens=16)  # fmt: skip
    runner, calls = engine.steps.drafter.runner, []
    forward = runner.forward

    def counted(chunks, *args, **kwargs):
        calls.append((len(engine.scheduler.running), sum(c.num_tokens for c in chunks)))
        return forward(chunks, *args, **kwargs)

    runner.forward = counted
    prompts = random_prompts([40, 9, 12, 20])
    params = [SamplingParams(max_tokens=n) for n in (40, 6, 8, 10)]
    assert [o.token_ids for o in engine.generate(prompts, params)] == [
        reference(model, p, n.max_tokens) for p, n in zip(prompts, params)
    ]
    assert calls and all(running <= 2 for running, _ in calls)
    assert max(tokens for _, tokens in calls) == 16  # the first request's 40 + tokens, caught up in pieces
    stats = engine.stats()
    assert stats["accepted_draft_tokens"] == stats["draft_tokens"] > 0
    assert stats["free_blocks"] == stats["num_blocks"]
