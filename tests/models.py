"""Tiny random-weight mlx-lm models for tests."""

import importlib

import mlx.core as mx

ARCHS = ("llama", "qwen2", "qwen3")


def tiny_model(arch: str = "llama", seed: int = 0, **overrides):
    """A 2-layer GQA model of ``arch`` with random weights (vocab 256, head_dim 32).

    head_dim 32, not 16: MLX 0.32.4's CUDA RoPE fails to launch for head_dim 16 with
    an offset array over 128 rows.
    """
    module = importlib.import_module(f"mlx_lm.models.{arch}")
    config = dict(
        model_type=arch,
        hidden_size=128,
        num_hidden_layers=2,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        rms_norm_eps=1e-5,
        vocab_size=256,
        rope_theta=10000.0,
        max_position_embeddings=4096,
        tie_word_embeddings=arch != "qwen3",
    )
    if arch == "qwen3":
        config["head_dim"] = 32
    config.update(overrides)
    mx.random.seed(seed)
    model = module.Model(module.ModelArgs(**config))
    mx.eval(model.parameters())
    return model
