"""The self-check at load: models the paged path gets wrong are refused, with reasons; verdicts are kept."""

import json

import mlx.core as mx
import pytest
from models import tiny_any, tiny_model
from test_engine import random_prompts, reference

from llm_paged_mlx import Engine, SamplingParams
from llm_paged_mlx.engine import model_check
from llm_paged_mlx.kernels.portable import PortableKernel
from llm_paged_mlx.models import attention_hook


@pytest.fixture(autouse=True)
def fresh_verdicts(monkeypatch):
    """Each test checks its models itself, whatever ran before it in this process."""
    monkeypatch.setattr(model_check, "_verdicts", {})


def model_verdicts(path) -> dict:
    """The model check's verdicts in a verdict file (on a GPU the fused kernels' self-checks keep theirs there
    too)."""
    return {key: v for key, v in json.loads(path.read_text()).items() if not key.startswith("kernel ")}


def count_checks(monkeypatch) -> list:
    """Record every check that runs (not answered from a kept verdict)."""
    runs = []
    verdict = model_check._verdict

    def counted(model, runner):
        runs.append(model)
        return verdict(model, runner)

    monkeypatch.setattr(model_check, "_verdict", counted)
    return runs


def test_plamo_is_refused():
    """plamo tiles K/V heads after update_and_fetch (query head h reads h % n_kv): the paged kernel cannot."""
    with pytest.raises(ValueError, match=r"^plamo: paged attention gives different logits than mlx-lm \(relative"):
        Engine(tiny_any("plamo"), num_blocks=16)


def decode_only(factor):
    """A portable kernel whose attention is off by ``factor`` in steps of decode rows only (compiled steps)."""
    attend = PortableKernel.__call__

    def wrong(self, queries, k_pool, v_pool, plan, scale):
        out = attend(self, queries, k_pool, v_pool, plan, scale)
        return out * factor if plan.num_decode == plan.num_rows else out

    return wrong


@pytest.mark.parametrize("dtype, factor", [(mx.float32, 1.02), (mx.float16, 1.05), (mx.bfloat16, 1.1)])
def test_attention_wrong_only_in_compiled_decode_steps_is_refused(dtype, factor, monkeypatch):
    monkeypatch.setattr(PortableKernel, "__call__", decode_only(factor))
    model = tiny_model("llama")
    model.set_dtype(dtype)
    with pytest.raises(ValueError, match=r"^llama: .* at the 46-token prompt's decode step 1 \(position 46\)"):
        Engine(model, num_blocks=16, attention_kernel="portable")


def test_exact_models_pass_and_leave_the_engine_as_new():
    model = tiny_model("qwen3")
    engine = Engine(model, num_blocks=16)
    assert engine.stats()["free_blocks"] == 15
    assert all(cache.plan is None for cache in engine.runner.kv.caches)
    prompts = random_prompts([30, 7], seed=2)
    outputs = engine.generate(prompts, SamplingParams(max_tokens=12))
    assert [o.token_ids for o in outputs] == [reference(model, p, 12) for p in prompts]


def test_a_model_that_cannot_be_traced_runs_eagerly_not_refused():
    """dbrx reads array values in its forward: its compiled steps fail, the runner falls back to eager."""
    model = tiny_any("dbrx")
    with pytest.warns(RuntimeWarning, match="cannot be compiled"):
        engine = Engine(model, num_blocks=16)
    assert not engine.runner.compile_steps
    prompts = random_prompts([20, 9], seed=3)
    outputs = engine.generate(prompts, SamplingParams(max_tokens=6))
    assert [o.token_ids for o in outputs] == [reference(model, p, 6) for p in prompts]


@pytest.mark.parametrize(
    "arch, overrides, reason",
    [
        ("bitnet", {}, "mlx-lm's own forward fails: RuntimeError"),  # a Metal kernel, on the CPU
        ("afm7", {}, "fails on the paged cache: AttributeError: 'PagedLayerCache' object has no attribute 'keys_"),
        # Its logits mask needs the real vocabulary (ids up to 100351).
        ("phi3small", {"vocab_size": 100352}, "layer 0 does not pass its cache to scaled_dot_product_attention"),
    ],
    ids=["bitnet", "afm7", "phi3small"],
)
def test_refusals_name_the_architecture_and_the_reason(arch, overrides, reason):
    with pytest.raises(ValueError, match=f"^{arch}: ") as refused:
        Engine(tiny_any(arch, **overrides), num_blocks=16)
    assert reason in str(refused.value)


def test_latent_attention_is_told_by_what_the_cache_holds():
    """youtu_llm has a kv_lora_rank but caches full per-head K/V: it is served."""
    model = tiny_any("youtu_llm")
    assert model.config.kv_lora_rank
    prompt = random_prompts([20], seed=4)[0]
    output = Engine(model, num_blocks=16).generate([prompt], SamplingParams(max_tokens=6))[0]
    assert output.token_ids == reference(model, prompt, 6)


def test_a_verdict_is_reached_once_per_fingerprint(monkeypatch):
    runs = count_checks(monkeypatch)
    model = tiny_model("llama")
    Engine(model, num_blocks=16)
    Engine(tiny_model("llama", seed=1), num_blocks=32)  # other weights, other pool: the same code path
    assert len(runs) == 1
    Engine(model, num_blocks=16, block_size=8)
    Engine(model, num_blocks=16, compile_steps=False)
    assert len(runs) == 3
    with pytest.raises(ValueError):
        Engine(tiny_any("plamo"), num_blocks=16)
    with pytest.raises(ValueError, match="^plamo: paged attention"):  # refusals are kept too
        Engine(tiny_any("plamo"), num_blocks=16)
    assert len(runs) == 4


def test_the_fingerprint_follows_the_code_path_not_the_weights():
    model = tiny_model("llama")
    runner = Engine(model, num_blocks=16).runner
    fingerprint = model_check.fingerprint(model, runner)
    assert model_check.fingerprint(tiny_model("llama", seed=5), runner) == fingerprint
    assert model_check.fingerprint(tiny_model("llama", rope_theta=500.0), runner) != fingerprint
    model.set_dtype(mx.bfloat16)
    assert model_check.fingerprint(model, runner) != fingerprint


def test_verdicts_round_trip_through_the_verdict_file(tmp_path, monkeypatch):
    path = tmp_path / "verdicts.json"
    model, plamo = tiny_model("llama"), tiny_any("plamo")
    Engine(model, num_blocks=16, verdict_file=path)
    with pytest.raises(ValueError):
        Engine(plamo, num_blocks=16, verdict_file=path)
    passed, refused = sorted(model_verdicts(path).values(), key=lambda v: v or "")
    assert passed is None and refused.startswith("plamo: paged attention")

    monkeypatch.setattr(model_check, "_verdicts", {})  # as in a new process
    runs = count_checks(monkeypatch)
    Engine(model, num_blocks=16, verdict_file=path)
    with pytest.raises(ValueError, match="^plamo: paged attention"):
        Engine(plamo, num_blocks=16, verdict_file=path)
    assert runs == []


def test_a_corrupt_verdict_file_is_ignored_and_rewritten(tmp_path, monkeypatch):
    path = tmp_path / "verdicts.json"
    path.write_text('{"truncated": ')
    runs = count_checks(monkeypatch)
    Engine(tiny_model("llama"), num_blocks=16, verdict_file=path)
    assert len(runs) == 1
    assert list(model_verdicts(path).values()) == [None]
    assert [p.name for p in tmp_path.iterdir()] == ["verdicts.json"]  # no temporary file left


@pytest.mark.parametrize("block_size, num_blocks", [(16, 4), (16, 6), (1, 10)])
def test_a_pool_too_small_for_the_check_gets_a_pool_of_its_own(block_size, num_blocks):
    model = tiny_model("llama")
    engine = Engine(model, block_size=block_size, num_blocks=num_blocks)
    assert engine.stats()["free_blocks"] == num_blocks - 1
    prompt = random_prompts([(num_blocks - 1) * block_size - 4], seed=6)[0]
    assert engine.generate([prompt], SamplingParams(max_tokens=3))[0].token_ids == reference(model, prompt, 3)


def test_a_check_that_fails_with_an_error_refuses_now_and_keeps_nothing(tmp_path, monkeypatch):
    path = tmp_path / "verdicts.json"
    reference_logits = model_check._reference

    def out_of_memory(*args):
        raise MemoryError("no room for the check")

    monkeypatch.setattr(model_check, "_reference", out_of_memory)
    with pytest.raises(ValueError, match="^llama: mlx-lm's own forward fails: MemoryError: no room"):
        Engine(tiny_model("llama"), num_blocks=16, verdict_file=path)
    assert not path.exists() or model_verdicts(path) == {}
    monkeypatch.setattr(model_check, "_reference", reference_logits)
    Engine(tiny_model("llama"), num_blocks=16, verdict_file=path)  # the error has passed: the model is served
    assert list(model_verdicts(path).values()) == [None]


def test_a_verdict_file_that_cannot_be_written_only_warns(tmp_path):
    path = tmp_path / "verdicts.json"
    path.mkdir()
    with pytest.warns(RuntimeWarning, match="could not keep the model check's verdict"):
        Engine(tiny_model("llama"), num_blocks=16, verdict_file=path)


def test_stored_verdicts_that_are_not_verdicts_are_ignored(tmp_path, monkeypatch):
    model = tiny_model("llama")
    key = model_check.fingerprint(model, Engine(model, num_blocks=16, verify_model=False).runner)
    path = tmp_path / "verdicts.json"
    path.write_text(json.dumps({key: 5}))
    runs = count_checks(monkeypatch)
    Engine(model, num_blocks=16, verdict_file=path)
    assert len(runs) == 1 and json.loads(path.read_text()) == {key: None}


def test_a_verdict_is_about_this_code_not_another_version(monkeypatch):
    model = tiny_model("llama")
    runner = Engine(model, num_blocks=16, verify_model=False).runner
    key = model_check.fingerprint(model, runner)
    monkeypatch.setattr(model_check, "_own_code", lambda: "another version of the engine")
    assert model_check.fingerprint(model, runner) != key


@pytest.mark.parametrize("block_size", [1, 2, 3, 64])
def test_the_check_fits_any_block_size(block_size):
    Engine(tiny_model("llama"), block_size=block_size, num_blocks=16)


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16], ids=["fp32", "fp16", "bf16"])
def test_tolerances_leave_margin_both_ways(dtype, monkeypatch):
    """Exact models pass a third of their dtype's tolerance; plamo fails three times it."""
    tolerance = dict(model_check.TOLERANCE)
    monkeypatch.setattr(model_check, "TOLERANCE", {d: t / 3 for d, t in tolerance.items()})
    for arch in ("llama", "qwen3"):
        model = tiny_model(arch)
        model.set_dtype(dtype)
        Engine(model, num_blocks=16)
    monkeypatch.setattr(model_check, "TOLERANCE", {d: t * 3 for d, t in tolerance.items()})
    plamo = tiny_any("plamo")
    plamo.set_dtype(dtype)
    with pytest.raises(ValueError, match="^plamo: paged attention gives different logits"):
        Engine(plamo, num_blocks=16)


def test_a_model_whose_routing_flips_on_rounding_is_served_when_float32_attention_agrees(monkeypatch):
    """A top-k router (to experts, say) can jump on a rounding difference alone: a gpt-oss-20B-shaped bf16
    model does on the H200 (benchmarks/RESULTS.md). Here a row of the paged logits jumps as such a flip
    would, only when attention rounds in bf16; with that rounding taken out the paths agree: served."""
    paged, passes = model_check._paged, []

    def flipping(runner, *args):
        rows = paged(runner, *args)
        passes.append(attention_hook.in_float32())
        if not attention_hook.in_float32():
            rows[1] = rows[1][::-1]
        return rows

    monkeypatch.setattr(model_check, "_paged", flipping)
    model = tiny_model("llama")
    model.set_dtype(mx.bfloat16)
    engine = Engine(model, num_blocks=16)
    assert passes == [False, True]
    prompt = random_prompts([20], seed=5)[0]
    assert engine.generate([prompt], SamplingParams(max_tokens=6))[0].token_ids == reference(model, prompt, 6)


def test_attention_wrong_in_float32_too_is_refused_with_both_errors(monkeypatch):
    monkeypatch.setattr(PortableKernel, "__call__", decode_only(1.1))
    model = tiny_model("llama")
    model.set_dtype(mx.bfloat16)
    with pytest.raises(ValueError, match=r"relative error .* at the 46-token prompt's decode step 1 .*, and .* "
                       r"at the 46-token prompt's decode step 1 \(position 46\) with attention in float32"):
        Engine(model, num_blocks=16, attention_kernel="portable")


def test_float32_attention_hands_the_kernel_float32_queries_and_pools(monkeypatch):
    seen, attend = [], PortableKernel.__call__

    def recording(self, queries, k_pool, v_pool, plan, scale, **kwargs):
        seen.append((queries.dtype, k_pool.dtype, v_pool.dtype))
        return attend(self, queries, k_pool, v_pool, plan, scale, **kwargs)

    model = tiny_model("llama")
    model.set_dtype(mx.bfloat16)
    engine = Engine(model, num_blocks=16, attention_kernel="portable")
    monkeypatch.setattr(PortableKernel, "__call__", recording)
    prompt = random_prompts([20], seed=6)[0]
    with attention_hook.float32_attention():
        engine.generate([prompt], SamplingParams(max_tokens=1))
    assert seen and set(seen) == {(mx.float32,) * 3}
    seen.clear()
    engine.generate([prompt], SamplingParams(max_tokens=1))
    assert seen and set(seen) == {(mx.bfloat16,) * 3}
