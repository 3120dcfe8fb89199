"""Projections that read the same input run as one product (models/merged_projections.py)."""

import copy
import gc

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten

from llm_paged_mlx import Engine, SamplingParams
from llm_paged_mlx.models import merged_projections
from llm_paged_mlx.models.merged_projections import MergedPart, has_merged_projections, merge_projections
from llm_paged_mlx.models.quantized_rows import fold_quantized_rows
from faults import Fault, Injector, run_through_faults
from models import tiny_model
from test_engine import random_prompts, reference


def _shapes(model):
    return [(name, p.shape, p.dtype) for name, p in tree_flatten(model.parameters())]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])  # qwen2: projections with a bias; qwen3: q/k norms
@pytest.mark.parametrize("bits", [None, 4])
def test_a_merged_model_computes_what_it_computed_and_keeps_its_parameters(arch, bits):
    model = tiny_model(arch)
    if bits:
        nn.quantize(model, group_size=32, bits=bits)
        fold_quantized_rows(model)
    rows = mx.array([[3], [17], [40], [200]])  # an engine step: a token per row
    sequence = mx.array([[3, 17, 40, 200, 9]])
    want = [model(rows), model(sequence)]
    shapes = _shapes(model)
    assert merge_projections(model) == 2 * len(model.layers)  # attention's q/k/v and the MLP's gate/up, each layer
    attention = model.layers[0].self_attn
    assert all(type(getattr(attention, name)) is MergedPart for name in ("q_proj", "k_proj", "v_proj"))
    assert _shapes(model) == shapes  # same names, shapes and dtypes: the parts' arrays view the merged ones
    for got, expected in zip([model(rows), model(sequence)], want):  # BLAS may round another width otherwise
        assert mx.allclose(got, expected, rtol=1e-5, atol=1e-5).item()
    assert attention.q_proj.product._input is None  # every part served: no activations held past the layer
    assert merge_projections(model) == 0  # merged once only


def test_projections_that_differ_are_left_alone():
    model = tiny_model("llama", num_hidden_layers=3)

    class Adapted(nn.Linear):
        """A LoRA-style layer of its own class."""

    first, second, third = model.layers
    adapted = Adapted(128, 64, bias=False)
    first.self_attn.k_proj = adapted
    second.self_attn.v_proj = nn.Linear(128, 64, bias=True)  # a bias where its group has none
    third.mlp.up_proj = nn.QuantizedLinear.from_linear(third.mlp.up_proj, group_size=32, bits=8)
    third.mlp.gate_proj = nn.QuantizedLinear.from_linear(third.mlp.gate_proj, group_size=32, bits=4)
    assert merge_projections(model) == 3  # the MLPs of the first two layers and the third layer's attention
    assert first.self_attn.k_proj is adapted and type(first.self_attn.q_proj) is nn.Linear
    assert type(second.self_attn.q_proj) is nn.Linear
    assert type(third.mlp.gate_proj) is nn.QuantizedLinear and type(third.self_attn.q_proj) is MergedPart


def test_merging_adds_no_memory():
    model = tiny_model("llama", hidden_size=512, intermediate_size=1024)
    gc.collect()
    before = mx.get_active_memory()
    mx.reset_peak_memory()
    merge_projections(model)
    gc.collect()
    weights = sum(p.nbytes for _, p in tree_flatten(model.parameters()))
    assert mx.get_active_memory() - before < weights // 20  # the parts' arrays are views, the old ones freed
    # A group's old arrays go as it is merged: at most one group (here a quarter of the weights) is held twice.
    assert mx.get_peak_memory() - before < weights // 3


@pytest.mark.parametrize("bits", [None, 4])
def test_an_engine_over_merged_projections_gives_mlx_lm_s_tokens(bits):
    model = tiny_model("qwen3")
    if bits:
        nn.quantize(model, group_size=32, bits=bits)
    unmerged = copy.deepcopy(model)  # mlx-lm's reference runs on the model's own layers
    fold_quantized_rows(model)  # as an engine on a GPU does, before it merges
    merge_projections(model)
    prompts = random_prompts([40, 70, 9], seed=3)
    outputs = Engine(model).generate(prompts, SamplingParams(max_tokens=12))
    assert [o.token_ids for o in outputs] == [reference(unmerged, p, 12) for p in prompts]


# A fault in a step's first trace that its eager run then escapes runs the model's steps eagerly from then on.
@pytest.mark.filterwarnings("ignore:steps of this model cannot be compiled:RuntimeWarning")
@pytest.mark.parametrize("error", [Fault, KeyboardInterrupt])
def test_a_step_whose_merged_product_fails_is_undone(error, monkeypatch):
    """A merged product that raises part way through a layer (some parts served, others not): the step is
    undone, the next product of that group is computed afresh, and every request gets mlx-lm's tokens."""
    model = tiny_model("llama")
    unmerged = copy.deepcopy(model)
    merge_projections(model)
    prompts = random_prompts([40, 70, 9, 25], seed=4)
    engine = Engine(model, num_blocks=64)
    injector = Injector(monkeypatch, merged_projections.MergedProduct, "columns", [2, 13, 14, 30], error)
    got = run_through_faults(engine, prompts, SamplingParams(max_tokens=12), (error,))
    assert injector.failures == 4
    assert got == [reference(unmerged, p, 12) for p in prompts]
    assert engine.stats()["free_blocks"] == engine.stats()["num_blocks"]


@pytest.mark.skipif(mx.default_device() == mx.gpu, reason="on a GPU the engine merges them (test_kernels_cuda.py)")
def test_an_engine_on_the_cpu_leaves_the_projections_as_they_are():
    model = tiny_model("llama")
    Engine(model)
    assert type(model.layers[0].self_attn.q_proj) is nn.Linear  # merged on GPUs only, where encoding sets the pace


def test_parameters_set_anew_are_merged_again():
    model, plain = tiny_model("qwen2"), tiny_model("qwen2", seed=1)  # qwen2: biases too
    merge_projections(model)
    tokens = mx.array([[3, 17, 40, 200, 9]])
    model.load_weights(list(tree_flatten(plain.parameters())))
    assert mx.allclose(model(tokens), plain(tokens), rtol=1e-5, atol=1e-5).item()
    model.set_dtype(mx.float16)
    plain.set_dtype(mx.float16)
    got = model(tokens)
    assert got.dtype == mx.float16 and mx.allclose(got, plain(tokens), rtol=1e-2, atol=1e-2).item()
    assert model.layers[0].self_attn.q_proj.product.merged.weight.dtype == mx.float16  # the float32 ones let go


def test_a_merge_that_does_not_give_each_part_its_own_product_is_left_undone(monkeypatch):
    model = tiny_model("llama")
    want = model(mx.array([[3, 17, 40]]))
    monkeypatch.setattr(merged_projections, "_bounds", lambda widths: [(0, w) for w in widths])  # wrong columns
    with pytest.warns(UserWarning, match="4 groups of projections gave other values merged than apart"):
        assert merge_projections(model) == 0
    assert not has_merged_projections(model) and type(model.layers[0].self_attn.k_proj) is nn.Linear
    assert mx.array_equal(model(mx.array([[3, 17, 40]])), want).item()


def test_a_tensor_parallel_engine_refuses_a_model_already_merged():
    class TwoRanks:  # refused before the group is used
        def size(self):
            return 2

    model = tiny_model("llama")
    merge_projections(model)
    with pytest.raises(ValueError, match="projections were merged by an engine on one device"):
        Engine(model, tensor_parallel=TwoRanks())
