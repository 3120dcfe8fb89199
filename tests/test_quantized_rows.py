"""Quantized linear and MLA per-head layers fold a step's rows into one matrix product (models/quantized_rows.py)."""

import copy

import mlx.core as mx
import mlx.nn as nn
import pytest

from llm_paged_mlx import Engine, SamplingParams
from mlx_lm.models.mla import MultiLinear

from llm_paged_mlx.models.quantized_rows import (
    RowFoldedMultiLinear,
    RowFoldedQuantizedEmbedding,
    RowFoldedQuantizedLinear,
    RowFoldedQuantizedMultiLinear,
    fold_quantized_rows,
)
from models import tiny_any, tiny_model
from test_engine import random_prompts, reference


def test_folded_layers_give_the_same_values_for_rows_and_for_a_sequence():
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
