"""The model runner's compiled row steps: same tokens as mlx-lm and as eager steps, pools updated in place."""

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models import llama
from models import tiny_any, tiny_model
from test_engine import collect, random_prompts, reference, run_staggered

from llm_paged_mlx import Engine, SamplingParams
import llm_paged_mlx.engine.runner as runner_module
from llm_paged_mlx.engine.request import Request
from llm_paged_mlx.engine.block_manager import SequenceBlocks, WindowedBlocks
from llm_paged_mlx.engine.runner import ModelRunner, padded_size, table_rows
from llm_paged_mlx.engine.scheduler import ScheduledChunk
from llm_paged_mlx.kernels.fused import CudaKernel
from llm_paged_mlx.kernels.portable import PortableKernel
from llm_paged_mlx.models.adapt import check_model

LENGTHS = [1, 3, 15, 16, 17, 40, 90, 5, 9, 33, 64]  # 11 rows decode together: 12 with padding


def test_padded_size_rounds_up_by_at_most_a_quarter():
    assert [padded_size(n) for n in range(1, 9)] == [1, 2, 3, 4, 5, 6, 7, 8]
    assert [padded_size(n) for n in (9, 10, 17, 33, 64, 65, 100)] == [10, 10, 20, 40, 64, 80, 112]
    for n in range(1, 5000):
        assert n <= padded_size(n) <= n * 1.25
    # few shapes: four per power of two
    assert len({padded_size(n) for n in range(1025, 2049)}) == 4


def test_table_rows_pad_with_the_null_block_and_show_a_window_s_live_blocks_only():
    plain, empty = SequenceBlocks(table=[7, 3, 9]), SequenceBlocks()
    # A window whose first two entries it passed (nulls), and one that still holds a passed prefix block.
    passed = WindowedBlocks(table=[0, 0, 5, 6], live_from=2, window=32)
    holds = WindowedBlocks(table=[4, 8, 2], live_from=1, window=32)
    rows = table_rows([plain, empty, passed, holds], width=5)
    assert rows.dtype == np.int32
    assert rows.tolist() == [[7, 3, 9, 0, 0], [0] * 5, [0, 0, 5, 6, 0], [0, 8, 2, 0, 0]]


def count_paths(monkeypatch):
    """Count the steps that take the compiled row path and the eager path."""
    counts = {"rows": 0, "eager": 0}
    for name, key in (("_forward_rows", "rows"), ("_forward_eager", "eager")):
        original = getattr(ModelRunner, name)

        def counted(self, *args, _original=original, _key=key):
            counts[_key] += 1
            return _original(self, *args)

        monkeypatch.setattr(ModelRunner, name, counted)
    return counts


@pytest.mark.parametrize("arch", ["llama", "qwen3", "phi3"])  # phi3: the head is not split off
def test_compiled_and_eager_steps_give_mlx_lm_tokens(arch, monkeypatch):
    counts = count_paths(monkeypatch)
    model = tiny_model(arch)
    prompts = random_prompts(LENGTHS, seed=3)
    got = {}
    for compile_steps in (True, False):
        # The portable kernel takes no prefill chunk as rows (fused kernels would take these short ones).
        engine = Engine(
            model, num_blocks=48, max_num_batched_tokens=64, attention_kernel="portable", compile_steps=compile_steps
        )
        got[compile_steps] = run_staggered(engine, prompts, SamplingParams(max_tokens=20), first=3)
        assert engine.stats()["free_blocks"] == 47
        if compile_steps:
            assert counts["rows"] > 20 and counts["eager"] > 0  # decode steps compiled, prefill steps not
            counts.update(rows=0, eager=0)
        else:
            assert counts["rows"] == 0
    assert got[True] == got[False]
    for prompt, tokens in zip(prompts, got[True]):
        assert tokens == reference(model, prompt, 20), f"prompt of {len(prompt)} tokens"


def test_prefill_chunks_served_as_rows_give_mlx_lm_tokens(monkeypatch):
    """A kernel that takes prefill chunks as rows gets every step as decode rows, padding included."""
    counts = count_paths(monkeypatch)
    monkeypatch.setattr(PortableKernel, "prefill_as_rows", lambda self, n, context: True, raising=False)
    model = tiny_model("qwen2")
    prompts = random_prompts(LENGTHS + [300], seed=4)
    engine = Engine(model, num_blocks=28, max_num_batched_tokens=96, attention_kernel="portable")
    outputs = run_staggered(engine, prompts, SamplingParams(max_tokens=16), first=4)
    assert counts["eager"] == 0 and counts["rows"] > 0
    assert engine.stats()["preemptions"] > 0
    for prompt, tokens in zip(prompts, outputs):
        assert tokens == reference(model, prompt, 16), f"prompt of {len(prompt)} tokens"


def test_kernels_that_are_not_compilable_run_eagerly(monkeypatch):
    counts = count_paths(monkeypatch)
    monkeypatch.setattr(PortableKernel, "compilable", False)
    model = tiny_model("llama")
    engine = Engine(model, num_blocks=32, attention_kernel="portable")
    prompts = random_prompts([5, 33], seed=5)
    outputs = engine.generate(prompts, SamplingParams(max_tokens=10))
    assert not engine.runner.compile_steps and counts["rows"] == 0
    assert [o.token_ids for o in outputs] == [reference(model, p, 10) for p in prompts]


def buffer_address(array: mx.array) -> int:
    return np.asarray(memoryview(array)).__array_interface__["data"][0]


@pytest.mark.parametrize("compile_steps", [True, False])
def test_steps_update_the_pools_in_place(compile_steps):
    """A step writes into the pools' own buffers: copying them would cost a pool's size per step."""
    engine = Engine(tiny_model("llama"), num_blocks=64, compile_steps=compile_steps)
    for prompt in random_prompts([20, 30, 40], seed=6):
        engine.add_request(prompt, SamplingParams(max_tokens=30))
    engine.step()
    addresses = [buffer_address(pool) for pool in engine.runner.kv.arrays()]
    for _ in range(5):
        engine.step()
    assert [buffer_address(pool) for pool in engine.runner.kv.arrays()] == addresses


def test_fused_kernels_take_short_prefill_chunks_as_rows():
    kernel = CudaKernel()  # the rule alone: nothing is compiled or run
    assert kernel.prefill_as_rows(32, 4096) and kernel.prefill_as_rows(160, 160)
    assert not kernel.prefill_as_rows(128, 4096) and not kernel.prefill_as_rows(16, 32768)


def test_traces_are_dropped_past_the_cap(monkeypatch):
    """Past MAX_TRACED_SHAPES shapes the runner starts a new compiled function; tokens stay right."""
    monkeypatch.setattr(runner_module, "MAX_TRACED_SHAPES", 2)
    compiled = []  # every compiled function the runner used
    compiled_for = ModelRunner._compiled_for

    def recorded(self, shape):
        compiled.append(compiled_for(self, shape))
        return compiled[-1]

    monkeypatch.setattr(ModelRunner, "_compiled_for", recorded)
    model = tiny_model("llama")
    engine = Engine(model, num_blocks=64)
    prompts = random_prompts([3, 20, 40, 70], seed=7)
    outputs = run_staggered(engine, prompts, SamplingParams(max_tokens=40), first=1, steps_between=2)
    assert len(set(map(id, compiled))) >= 3 and 1 <= len(engine.runner._traced_shapes) <= 2
    for prompt, tokens in zip(prompts, outputs):
        assert tokens == reference(model, prompt, 40)


@pytest.mark.parametrize("run_ahead", [True, False])
def test_a_failing_step_leaves_the_engine_usable(monkeypatch, run_ahead):
    """An error while a step is built reaches the caller; the pools stay real, the step's requests
    give back its slots, and they (and later requests) go on to mlx-lm's tokens."""
    model = tiny_model("llama")
    engine = Engine(model, num_blocks=32, attention_kernel="portable")
    prompts = random_prompts([16, 12, 7], seed=8)
    params = SamplingParams(max_tokens=8)
    first = engine.add_request(prompts[0], params)
    engine.step()  # prefill, eager
    if not run_ahead:  # a waiting request: the next step is scheduled after reading this one
        engine.add_request(prompts[1], params)
    free_before = engine.stats()["free_blocks"]
    attend = PortableKernel.__call__

    def failing(self, *args):
        raise RuntimeError("kernel failed")

    monkeypatch.setattr(PortableKernel, "__call__", failing)
    with pytest.raises(RuntimeError, match="kernel failed"):
        engine.step()  # decode: position 16 takes a new block, given back when the step fails
    monkeypatch.setattr(PortableKernel, "__call__", attend)
    pools = engine.runner.kv.arrays()
    mx.eval(pools)  # placeholders of a trace could not be evaluated
    assert all(p.shape == pools[0].shape for p in pools)
    assert engine.stats()["free_blocks"] == free_before  # the slots taken for the failed step are back
    outputs = {}
    while engine.has_unfinished():
        collect(engine.step(), outputs)
    assert outputs[first] == reference(model, prompts[0], 8)
    assert engine.generate([prompts[2]], params)[0].token_ids == reference(model, prompts[2], 8)
    assert engine.stats()["free_blocks"] == 31


@pytest.mark.parametrize("compile_steps", [True, False])
def test_a_rollback_writes_back_the_protected_blocks(compile_steps):
    """Writes into protected blocks (a swap-in, a disk load, a step's K/V) are undone by a rollback, though a
    write makes the very array object it writes to stand for the new value."""
    engine = Engine(tiny_model("llama"), num_blocks=16, compile_steps=compile_steps)
    engine.generate(random_prompts([40], seed=9), SamplingParams(max_tokens=4))
    runner = engine.runner
    before = [np.array(pool) for pool in runner.kv.arrays()]
    runner.kv.begin()
    runner.kv.protect([1, 2])
    runner.kv.write_blocks([1, 2], [mx.ones_like(a) for a in runner.kv.read_blocks([1, 2])])
    prompt = random_prompts([20], seed=10)[0]
    request = Request(-1, prompt, SamplingParams(), max_total_tokens=64)
    request.blocks.table = [1, 2, 3]
    runner.forward([ScheduledChunk(request, len(prompt), [list(range(16, 16 + len(prompt)))])])
    runner.kv.rollback()
    assert all(np.array_equal(np.array(pool), old) for pool, old in zip(runner.kv.arrays(), before))


def test_kernels_write_in_place_only_in_compiled_steps_whose_layers_own_their_pools(monkeypatch):
    """Where a kernel says it writes K/V in place (CUDA's), the runner lets it only in compiled steps of rows,
    and only where no two layers share pool arrays: a scatter after an in-place write of the same pool in one
    step would be ordered by values only. (Here a kernel that records the plans and declines, so MLX's scatter
    writes: the same tokens.)"""
    plans = []

    def declining(self, queries, k_flat, v_flat, index, keys, values, plan, *args, **kwargs):
        plans.append(plan)

    monkeypatch.setattr(PortableKernel, "in_place_writes", True, raising=False)
    monkeypatch.setattr(PortableKernel, "write_and_attend", declining, raising=False)
    monkeypatch.setattr(PortableKernel, "prefill_as_rows", lambda self, tokens, context: True, raising=False)
    model = tiny_model("llama")
    prompts = random_prompts([3, 20, 40], seed=9)
    engine = Engine(model, num_blocks=64)
    got = [o.token_ids for o in engine.generate(prompts, SamplingParams(max_tokens=12))]
    assert got == [reference(model, p, 12) for p in prompts]
    assert plans and all(p.in_place for p in plans)
    assert {p.one_token_per_sequence for p in plans} == {True, False}  # decode steps, and prompts as rows
    assert not any(c.decodes_in_place for c in engine.runner.kv.caches)  # the kernel declined every write
    plans.clear()
    shared = tiny_any("gemma3_text", sliding_window=16)  # a window layer and a full one share pool arrays
    Engine(shared, num_blocks=64).generate(prompts, SamplingParams(max_tokens=4))
    assert plans == []


def test_only_mlx_lm_s_own_body_then_head_models_project_sampled_rows_only():
    """Only where ``Model.__call__`` is mlx-lm's "body, then head" may a step leave out the rows it does not
    sample: a subclass may do more after the head (the tools tests' scripted model does)."""
    assert check_model(tiny_model("llama")).projects_sampled_rows_only
    assert check_model(tiny_model("qwen3")).projects_sampled_rows_only

    class Subclassed(llama.Model):
        pass

    model = tiny_model("llama")
    assert not check_model(Subclassed(model.args)).projects_sampled_rows_only
    assert not check_model(tiny_any("gemma2")).projects_sampled_rows_only  # softcaps its logits after the head


def record_pacing(monkeypatch, paces=True):
    """Make eager steps pace their layers here (on GPUs only, otherwise), and record each layer output paced and
    every queue and wait of one: a list of (layer index, "queue" or "wait") as they happen."""
    from llm_paged_mlx.kernels.plan import AttentionPlan

    monkeypatch.setattr(runner_module, "paces_layers", lambda: paces)
    layers, events = [], []
    queue, wait, pace = mx.async_eval, mx.eval, AttentionPlan.pace

    def index(array):
        return next((i for i, layer in enumerate(layers) if layer is array), None)

    def spy(kind, call):
        def spied(*arrays):
            events.extend((index(a), kind) for a in arrays if index(a) is not None)
            return call(*arrays)

        return spied

    def recorded(plan, out, overlap=True):
        layers.append(out)
        return pace(plan, out, overlap)

    monkeypatch.setattr(mx, "async_eval", spy("queue", queue))
    monkeypatch.setattr(mx, "eval", spy("wait", wait))
    monkeypatch.setattr(AttentionPlan, "pace", recorded)
    return layers, events


@pytest.mark.parametrize("arch", ["llama", "gpt_oss"])  # gpt_oss: windowed and full layers, two plans a step
def test_a_prefill_step_waits_for_each_layer_only_after_queuing_the_next(arch, monkeypatch):
    """Eager prefill steps keep the device a layer ahead of the host (``LayerPacer``): each layer's attention
    output is queued, and the host waits for it once the next layer's, of whatever group, is queued too."""
    layers, events = record_pacing(monkeypatch)
    model = tiny_model("llama", num_hidden_layers=4) if arch == "llama" else tiny_any(arch, num_hidden_layers=4)
    engine = Engine(model, num_blocks=32, attention_kernel="portable", enable_prefix_caching=False)
    layers.clear(), events.clear()  # the model check's steps
    engine.add_request(random_prompts([40], seed=7)[0], SamplingParams(max_tokens=1))
    engine.step()
    assert len(layers) == 4  # the prompt's one step, a call a layer
    expected = [(0, "queue")]
    for layer in range(1, 4):  # the last layer is read with the step's tokens
        expected += [(layer, "queue"), (layer - 1, "wait")]
    assert events[: len(expected)] == expected


def test_a_layer_whose_attention_may_hold_half_the_allowance_is_waited_for_at_once(monkeypatch):
    from llm_paged_mlx.models import paged_cache

    layers, events = record_pacing(monkeypatch)
    model = tiny_model("llama", num_hidden_layers=3)
    engine = Engine(model, num_blocks=32, attention_kernel="portable", enable_prefix_caching=False)
    monkeypatch.setattr(paged_cache, "PREFILL_ATTENTION_BYTES", 64 * 1024)  # a 40-token chunk's gather takes more
    layers.clear(), events.clear()
    engine.add_request(random_prompts([40], seed=7)[0], SamplingParams(max_tokens=1))
    engine.step()
    assert events[:3] == [(0, "wait"), (1, "wait"), (2, "wait")]


def test_a_layer_waited_for_at_once_waits_for_the_one_queued_before_it_first(monkeypatch):
    """Two layers' attention stay within the allowance: a large layer's work is queued only once the layer
    queued before it is done."""
    from llm_paged_mlx.models import paged_cache

    layers, events = record_pacing(monkeypatch)
    engine = Engine(tiny_model("llama", num_hidden_layers=3), num_blocks=32, attention_kernel="portable")
    overlaps = iter([True, False, True])
    monkeypatch.setattr(paged_cache, "_overlaps", lambda *args: next(overlaps))
    layers.clear(), events.clear()
    engine.add_request(random_prompts([40], seed=7)[0], SamplingParams(max_tokens=1))
    engine.step()
    assert events == [(0, "queue"), (0, "wait"), (1, "wait"), (2, "queue")]


def test_without_pacing_a_prefill_step_waits_for_each_layer_at_once(monkeypatch):
    """The CPU's way (``paces_layers``): its computation dwarfs building a layer, and waiting for each layer
    holds less memory."""
    layers, events = record_pacing(monkeypatch, paces=False)
    engine = Engine(tiny_model("llama", num_hidden_layers=3), num_blocks=32, attention_kernel="portable")
    layers.clear(), events.clear()
    engine.add_request(random_prompts([40], seed=7)[0], SamplingParams(max_tokens=1))
    engine.step()
    assert events[:3] == [(0, "wait"), (1, "wait"), (2, "wait")]
