"""Quantized K/V on the real SmolLM2: the engine loses no more than mlx-lm's QuantizedKVCache.

The measurement is ``benchmarks/kv_quality.py``'s, on a shorter text: 384 tokens fed in chunks of
128, each position's next-token distribution compared (KL) with the same system at full precision.
mlx-lm's quantized attention is slow on the CPU (about half of this module's time), hence the length.
"""

import sys
from pathlib import Path

import pytest
from smollm2 import smollm2_dir

from llm_paged_mlx.models.loading import ModelFetchError, load_model

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from kv_quality import BITS, measure_quality, text_tokens  # noqa: E402



@pytest.fixture(scope="module")
def quality():
    try:
        path = smollm2_dir()
    except ModelFetchError as e:
        pytest.skip(f"SmolLM2 is not cached and cannot be fetched: {e}")
    model, tokenizer = load_model(str(path), dequantize=True, dtype="float32")
    tokens, _ = text_tokens(tokenizer, 384)
    return measure_quality(model, tokens, chunk=128, bits=BITS)


def mean_kl(quality, system, bits):
    return float(quality[system, bits]["kl"].mean())


def test_full_precision_pools_give_mlx_lm_logits(quality):
    assert quality["full_max_abs_diff"] < 1e-3


@pytest.mark.parametrize("bits", BITS)
def test_quantized_pools_lose_no_more_than_mlx_lm(quality, bits):
    ours, theirs = mean_kl(quality, "engine", bits), mean_kl(quality, "mlx-lm", bits)
    # Both quantize the same K/V rows with the same scheme, so they differ only where float rounding
    # in attention moves a value to the next quantization step a few layers on: noise of a few
    # percent of the KL either way (benchmarks/RESULTS.md), which 1.1x leaves room for. The absolute
    # term covers that noise at 8 bits, where the KL itself is small; a real loss is far larger.
    assert ours <= 1.1 * theirs + 1e-4, f"{bits}-bit: engine KL {ours:.3e}, mlx-lm {theirs:.3e}"


def test_fewer_bits_lose_more_and_quantization_is_applied(quality):
    kl8, kl4 = mean_kl(quality, "engine", 8), mean_kl(quality, "engine", 4)
    # Pools that silently kept full precision would give a KL of 0 (or rounding noise far below 1e-5).
    assert kl4 > kl8 > 1e-5, f"engine KL: 8-bit {kl8:.3e}, 4-bit {kl4:.3e}"
    assert mean_kl(quality, "mlx-lm", 4) > mean_kl(quality, "mlx-lm", 8) > 1e-5
