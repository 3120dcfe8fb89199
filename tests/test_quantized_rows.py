"""Quantized linear and MLA per-head layers fold a step's rows into one matrix product (models/quantized_rows.py)."""

import copy
import dataclasses
import warnings

import mlx.core as mx
import mlx.nn as nn
import pytest

from llm_paged_mlx import Engine, SamplingParams
from mlx_lm.models.mla import MultiLinear

from llm_paged_mlx.engine.memory import step_reserve
from llm_paged_mlx.models import quantized_rows
from llm_paged_mlx.models.merged_projections import merge_projections
from llm_paged_mlx.models.quantized_rows import (
    CPU_DEQUANTIZED_ROWS,
    DEQUANTIZED_ROWS,
    MATVEC_ROWS,
    PADDED_ROWS,
    RowFoldedMultiLinear,
    RowFoldedQuantizedEmbedding,
    RowFoldedQuantizedLinear,
    RowFoldedQuantizedMultiLinear,
    fold_quantized_rows,
)
from models import tiny_any, tiny_model
from test_engine import random_prompts, reference


def test_folded_layers_give_the_same_values_for_rows_and_for_a_sequence(monkeypatch):
    """Folding alone (no route by rows: MLX's quantized product) gives the values bit for bit."""
    monkeypatch.setattr(quantized_rows, "device_routes", lambda: {})
    mx.random.seed(0)
    model = nn.Sequential(nn.Linear(64, 96), nn.Linear(96, 32))
    model.layers.append(nn.Embedding(32, 64))
    nn.quantize(model, group_size=32, bits=4)
    x = mx.random.normal((9, 1, 64))  # an engine step: 9 rows of one token each
    want = [model.layers[0](x), model.layers[2].as_linear(x)]
    assert fold_quantized_rows(model) == 3
    assert [type(layer) for layer in model.layers] == [
        RowFoldedQuantizedLinear,
        RowFoldedQuantizedLinear,
        RowFoldedQuantizedEmbedding,
    ]
    got = [model.layers[0](x), model.layers[2].as_linear(x)]
    for g, w in zip(got, want):
        assert g.shape == w.shape and mx.array_equal(g, w).item()
    assert fold_quantized_rows(model) == 0  # already folded: nothing changes twice


def routed_model(dtype, monkeypatch):
    """A quantized linear layer (with a bias) and embedding in ``dtype``, and the same folded with products by
    rows forced on (as on MLX's CUDA backend), their routes checked anew."""
    mx.random.seed(1)
    model = nn.Sequential(nn.Linear(128, 96, bias=True), nn.Embedding(96, 128))
    model.set_dtype(dtype)
    nn.quantize(model, group_size=32, bits=4)
    unfolded = copy.deepcopy(model)
    monkeypatch.setattr(quantized_rows, "device_routes", lambda: quantized_rows.CUDA_ROUTES)
    monkeypatch.setattr(quantized_rows, "_routes_agree", {})
    return unfolded, model


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, PADDED_ROWS - 1, PADDED_ROWS, 40, DEQUANTIZED_ROWS + 5])
def test_products_by_rows_take_routes_that_give_the_quantized_product(rows, dtype, monkeypatch):
    """Each route gives MLX's quantized product: 2-7 rows padded to 8, many half-precision rows through the
    dequantized weights."""
    unfolded, model = routed_model(dtype, monkeypatch)
    dequantized = folded_products_match(unfolded, model, mx.random.normal((rows, 1, 128)).astype(dtype), monkeypatch)
    assert bool(dequantized) == (rows >= DEQUANTIZED_ROWS and dtype == mx.bfloat16)


def folded_products_match(unfolded, model, x, monkeypatch) -> int:
    """Fold ``model`` (a linear layer and an embedding, as ``unfolded``) and check that its products of ``x`` are
    the unfolded model's (MLX's quantized product on this CPU); how many dequantized its weights."""
    want = [unfolded.layers[0](x), unfolded.layers[1].as_linear(x)]
    fold_quantized_rows(model)
    dequantized = []
    dequantize = mx.dequantize
    monkeypatch.setattr(mx, "dequantize", lambda *a, **k: dequantized.append(1) or dequantize(*a, **k))
    got = [model.layers[0](x), model.layers[1].as_linear(x)]
    tolerance = 1e-5 if x.dtype == mx.float32 else 3e-2  # MLX's bfloat16 quantized product on the CPU: about 1e-2
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.dtype == w.dtype
        g, w = g.astype(mx.float32), w.astype(mx.float32)
        assert (mx.linalg.norm(g - w) <= tolerance * mx.linalg.norm(w)).item()
    return len(dequantized)


@pytest.fixture
def on_the_cpu():
    """MLX's CPU as the default device, as on this machine (a Mac's default is its GPU)."""
    device = mx.default_device()
    mx.set_default_device(mx.cpu)
    yield
    mx.set_default_device(device)


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
@pytest.mark.parametrize("rows", [1, CPU_DEQUANTIZED_ROWS - 1, CPU_DEQUANTIZED_ROWS, 100])
def test_on_the_cpu_products_of_many_rows_multiply_the_dequantized_weights(rows, dtype, on_the_cpu, monkeypatch):
    """MLX's CPU quantized product takes its rows one at a time: from CPU_DEQUANTIZED_ROWS rows on, a product
    (of any dtype, the output head's too) multiplies the dequantized weights, with the quantized product's
    values; fewer rows keep MLX's product. A step's memory holds the dequantized weights from there."""
    mx.random.seed(1)
    model = nn.Sequential(nn.Linear(128, 96, bias=True), nn.Embedding(96, 128))
    model.set_dtype(dtype)
    nn.quantize(model, group_size=32, bits=4)
    unfolded = copy.deepcopy(model)
    monkeypatch.setattr(quantized_rows, "_routes_agree", {})
    dequantized = folded_products_match(unfolded, model, mx.random.normal((rows, 1, 128)).astype(dtype), monkeypatch)
    assert dequantized == (2 if rows >= CPU_DEQUANTIZED_ROWS else 0)
    assert quantized_rows.dequantized_rows() == CPU_DEQUANTIZED_ROWS
    assert quantized_rows.dequantized_bytes(model.layers[0]) == 96 * 128 * 4  # rows of any dtype: float32's room


@pytest.mark.parametrize("rows_dtype, scales_dtype", [(mx.float32, mx.float16), (mx.bfloat16, mx.float32)])
def test_on_the_cpu_rows_and_scales_of_other_dtypes_give_mlx_s_product(rows_dtype, scales_dtype, on_the_cpu,
                                                                       monkeypatch):  # fmt: skip
    """A float32 model over half-precision scales (as GGUF weights load), and the other way: the product in the
    wider dtype, with MLX's values, through the dequantized weights."""
    mx.random.seed(3)
    layer = nn.Linear(128, 96)
    layer.set_dtype(scales_dtype)
    model = nn.Sequential(layer)
    nn.quantize(model, group_size=32, bits=4)
    unfolded = copy.deepcopy(model)
    monkeypatch.setattr(quantized_rows, "_routes_agree", {})
    fold_quantized_rows(model)
    assert quantized_rows._passed(model.layers[0]) == {"dequantized": True}
    x = mx.random.normal((CPU_DEQUANTIZED_ROWS, 1, 128)).astype(rows_dtype)
    got, want = model.layers[0](x), unfolded.layers[0](x)
    assert got.dtype == want.dtype == mx.float32
    assert (mx.linalg.norm(got - want) <= 1e-5 * mx.linalg.norm(want)).item()


def test_on_the_cpu_an_engine_over_a_4_bit_model_prefills_through_the_dequantized_weights(on_the_cpu, monkeypatch):
    """A prompt's chunk multiplies the dequantized weights, one stream's decode steps MLX's quantized product:
    the greedy tokens are mlx-lm's."""
    model = tiny_model("llama")
    nn.quantize(model, group_size=32, bits=4)
    prompts = random_prompts([40, 9])
    expected = [reference(model, p, 8) for p in prompts]
    monkeypatch.setattr(quantized_rows, "_routes_agree", {})
    engine = Engine(model, num_blocks=64)
    quantized_product = quantized_rows._quantized_product
    rows = []  # of each product MLX's quantized product takes
    monkeypatch.setattr(quantized_rows, "_quantized_product",
                        lambda layer, x: rows.append(x.size // x.shape[-1]) or quantized_product(layer, x))  # fmt: skip
    dequantized = []  # of each product through the dequantized weights
    dequantize = mx.dequantize
    monkeypatch.setattr(mx, "dequantize", lambda *a, **k: dequantized.append(1) or dequantize(*a, **k))
    for prompt, want in zip(prompts, expected):
        rows.clear()
        dequantized.clear()
        (output,) = engine.generate([prompt], SamplingParams(max_tokens=8))
        assert output.token_ids == want
        assert dequantized  # the prompt's chunks
        assert rows and max(rows) < CPU_DEQUANTIZED_ROWS  # the decode steps, and the output head's one row


def test_routes_that_give_other_values_warn_and_are_not_taken(monkeypatch):
    unfolded, model = routed_model(mx.bfloat16, monkeypatch)
    for name, route in list(quantized_rows.CUDA_ROUTES.items()):
        wrong = lambda layer, x: 2 * quantized_rows._quantized_product(layer, x)  # noqa: E731
        monkeypatch.setitem(quantized_rows.CUDA_ROUTES, name, dataclasses.replace(route, product=wrong))
    with pytest.warns(RuntimeWarning, match=r"quantized products by rows \(dequantized\) gave other values"):
        fold_quantized_rows(model)
    for rows in (3, DEQUANTIZED_ROWS):
        x = mx.random.normal((rows, 1, 128)).astype(mx.bfloat16)
        assert mx.array_equal(model.layers[0](x), unfolded.layers[0](x)).item()
    assert quantized_rows.dequantized_bytes(model.layers[0]) == 0


def stand_in_matvec(calls: list):
    """The matvec kernel's product as MLX computes it (float32 over the dequantized weights), counting its calls:
    the CPU has no CUDA to run the kernel."""

    def matvec(x, w, scales, biases, bits, group_size):
        calls.append(x.shape)
        exact = mx.dequantize(w, scales, biases, group_size=group_size, bits=bits, dtype=mx.float32)
        return (x.astype(mx.float32) @ exact.T).astype(x.dtype)

    return matvec


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_few_rows_of_large_weights_take_the_matvec_kernel_once_it_passes_its_check(dtype, monkeypatch):
    """Up to MATVEC_ROWS rows of the scales' dtype, 2-D or folded, by weights of MATVEC_MIN_WEIGHTS values or more;
    more rows, rows of another dtype, or smaller weights do not."""
    unfolded, model = routed_model(dtype, monkeypatch)
    calls = []
    monkeypatch.setattr(quantized_rows, "matvec_available", lambda: True)
    monkeypatch.setattr(quantized_rows, "quantized_matvec", stand_in_matvec(calls))
    monkeypatch.setattr(quantized_rows, "MATVEC_MIN_WEIGHTS", 96 * 128)  # both layers' weights: 96 x 128 values
    fold_quantized_rows(model)
    # the check, once for both layers' quantization: fresh rows, and rows one value into an array
    assert calls == [(1, 128), (1, 128), (MATVEC_ROWS, 128), (MATVEC_ROWS, 128)]
    for shape in [(1, 1, 128), (MATVEC_ROWS, 1, 128), (MATVEC_ROWS, 128)]:
        calls.clear()
        x = mx.random.normal(shape).astype(dtype)
        got, want = model.layers[0](x), unfolded.layers[0](x)
        assert calls == [(x.size // 128, 128)]
        assert got.shape == want.shape and got.dtype == want.dtype
        tolerance = 1e-5 if dtype == mx.float32 else 3e-2
        got, want = got.astype(mx.float32), want.astype(mx.float32)
        assert (mx.linalg.norm(got - want) <= tolerance * mx.linalg.norm(want)).item()
    calls.clear()
    model.layers[0](mx.random.normal((MATVEC_ROWS + 1, 1, 128)).astype(dtype))
    other = mx.float16 if dtype == mx.bfloat16 else mx.bfloat16
    model.layers[0](mx.random.normal((1, 1, 128)).astype(other))
    model.layers[0](mx.zeros((0, 1, 128), dtype))  # no row: a step whose rows all continue a prompt
    monkeypatch.setattr(quantized_rows, "MATVEC_MIN_WEIGHTS", 96 * 128 + 1)
    model.layers[0](mx.random.normal((1, 1, 128)).astype(dtype))
    assert calls == []


def test_a_small_layer_checked_first_leaves_the_matvec_kernel_to_large_ones(monkeypatch):
    """A verdict holds for a quantization, whatever a layer's size: a tied output head (an embedding's weights,
    checked last) takes the kernel though a smaller layer of the same quantization was checked first."""
    mx.random.seed(2)
    model = nn.Sequential(nn.Linear(128, 16), nn.Embedding(96, 128))
    nn.quantize(model, group_size=32, bits=4)
    unfolded = copy.deepcopy(model)
    monkeypatch.setattr(quantized_rows, "device_routes", lambda: quantized_rows.CUDA_ROUTES)
    monkeypatch.setattr(quantized_rows, "_routes_agree", {})
    monkeypatch.setattr(quantized_rows, "matvec_available", lambda: True)
    calls = []
    monkeypatch.setattr(quantized_rows, "quantized_matvec", stand_in_matvec(calls))
    monkeypatch.setattr(quantized_rows, "MATVEC_MIN_WEIGHTS", 96 * 128)
    fold_quantized_rows(model)
    calls.clear()
    x = mx.random.normal((1, 1, 128))
    model.layers[0](x)
    assert calls == []  # 16 x 128 weights: MLX's product
    got = model.layers[1].as_linear(x)
    assert calls == [(1, 128)]
    assert mx.allclose(got, unfolded.layers[1].as_linear(x), atol=1e-5).item()


def test_a_route_check_that_fails_warns_and_leaves_mlx_s_product(monkeypatch):
    """A check that raises (a kernel MLX lacks, say) warns once and turns the routes off; Ctrl-C passes through
    and leaves no verdict, so the next load checks again."""
    unfolded, model = routed_model(mx.bfloat16, monkeypatch)

    def interrupted(layer, route):
        raise KeyboardInterrupt

    monkeypatch.setattr(quantized_rows, "_agrees", interrupted)
    with pytest.raises(KeyboardInterrupt):
        fold_quantized_rows(copy.deepcopy(model))
    assert quantized_rows._routes_agree == {}

    def broken(layer, route):
        raise RuntimeError("no implementation for this shape")

    monkeypatch.setattr(quantized_rows, "_agrees", broken)
    with pytest.warns(RuntimeWarning, match=r"quantized products by rows \(padded\) failed \(no implementation"):
        fold_quantized_rows(model)
    x = mx.random.normal((DEQUANTIZED_ROWS, 1, 128)).astype(mx.bfloat16)
    assert mx.array_equal(model.layers[0](x), unfolded.layers[0](x)).item()


def test_only_affine_quantization_takes_routes(monkeypatch):
    """Other modes (scales of their own dtype, as mxfp4's) keep MLX's quantized product, with no warning."""
    monkeypatch.setattr(quantized_rows, "device_routes", lambda: quantized_rows.CUDA_ROUTES)
    monkeypatch.setattr(quantized_rows, "_routes_agree", {})
    model = nn.Sequential(nn.QuantizedLinear(64, 32, group_size=32, bits=4, mode="mxfp4"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fold_quantized_rows(model)
    assert not quantized_rows.check_routes(model.layers[0])
    assert quantized_rows.dequantized_bytes(model.layers[0]) == 0


def test_a_step_reserves_the_largest_weights_it_dequantizes(monkeypatch):
    """Two of the largest: a layer's once a step multiplies ``DEQUANTIZED_ROWS`` rows by it, the output head's
    once as many logit rows reach it, merged projections as one."""
    model = tiny_model("llama")
    model.set_dtype(mx.bfloat16)
    nn.quantize(model, group_size=32, bits=4)
    monkeypatch.setattr(quantized_rows, "device_routes", lambda: {})
    fold_quantized_rows(model)
    shapes = [(64, 4), (2048, 4), (2048, 2048)]
    before = {shape: step_reserve(model, *shape) for shape in shapes}
    monkeypatch.setattr(quantized_rows, "device_routes", lambda: quantized_rows.CUDA_ROUTES)
    monkeypatch.setattr(quantized_rows, "_routes_agree", {})
    sizes = {}
    for name, module in model.named_modules():
        if isinstance(module, (RowFoldedQuantizedLinear, RowFoldedQuantizedEmbedding)):
            assert quantized_rows.check_routes(module)
            sizes[name] = quantized_rows.dequantized_bytes(module)
    head = sizes.pop("lm_head", None) or sizes.pop("model.embed_tokens")
    layers = max(sizes.values())
    assert head > layers > 0
    assert step_reserve(model, 64, 4) == before[(64, 4)]
    assert step_reserve(model, 2048, 4) == before[(2048, 4)] + 2 * layers
    assert step_reserve(model, 2048, 2048) == before[(2048, 2048)] + 2 * head
    mlp = model.model.layers[0].mlp
    merged = 2 * (mlp.gate_proj.weight.shape[0] + mlp.up_proj.weight.shape[0]) * mlp.gate_proj.weight.shape[1] * 8
    assert merge_projections(model) > 0
    assert step_reserve(model, 2048, 4) == before[(2048, 4)] + 2 * max(merged, layers)


def test_layers_of_other_classes_are_left_alone():
    class Custom(nn.QuantizedLinear):
        pass

    layer = Custom(64, 32, group_size=32, bits=4)
    model = nn.Sequential(layer, nn.Linear(32, 32))
    assert fold_quantized_rows(model) == 0
    assert type(layer) is Custom and type(model.layers[1]) is nn.Linear


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_an_engine_over_a_4_bit_model_gives_mlx_lm_s_tokens(arch):
    model = tiny_model(arch)
    nn.quantize(model, group_size=32, bits=4)
    unfolded = copy.deepcopy(model)  # mlx-lm's reference runs on MLX's own classes
    prompts = random_prompts([40, 70], seed=2)
    engine = Engine(model)
    assert any(isinstance(m, RowFoldedQuantizedLinear) for _, m in model.named_modules())
    outputs = engine.generate(prompts, SamplingParams(max_tokens=10))
    assert [o.token_ids for o in outputs] == [reference(unfolded, p, 10) for p in prompts]


@pytest.mark.parametrize("quantized", [False, True])
def test_per_head_layers_fold_rows_of_one_token_and_leave_sequences_alone(quantized):
    mx.random.seed(1)
    model = nn.Sequential(MultiLinear(64, 32, num_heads=4))
    if quantized:
        model.layers[0] = model.layers[0].to_quantized(group_size=32, bits=4)
    rows = mx.random.normal((9, 4, 1, 64))  # MLA's absorbed queries: 9 rows of one token, 4 heads
    sequence = mx.random.normal((1, 1, 7, 32))  # mlx-lm's prefill: a latent sequence, multiplied untransposed
    want = [model.layers[0](rows), model.layers[0](sequence, transpose=False)]
    assert fold_quantized_rows(model) == 1
    assert type(model.layers[0]) is (RowFoldedQuantizedMultiLinear if quantized else RowFoldedMultiLinear)
    got = [model.layers[0](rows), model.layers[0](sequence, transpose=False)]
    for g, w in zip(got, want):
        assert g.shape == w.shape and mx.allclose(g, w, atol=1e-5).item()


def test_an_engine_over_an_mla_model_gives_mlx_lm_s_tokens_with_folded_heads():
    model = tiny_any("deepseek_v3")
    unfolded = copy.deepcopy(model)
    prompts = random_prompts([40, 70], seed=3)
    engine = Engine(model)
    assert any(isinstance(m, RowFoldedMultiLinear) for _, m in model.named_modules())
    outputs = engine.generate(prompts, SamplingParams(max_tokens=10))
    assert [o.token_ids for o in outputs] == [reference(unfolded, p, 10) for p in prompts]
