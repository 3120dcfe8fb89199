"""Every model module of the installed mlx-lm, tiny and random: the engine refuses it or matches mlx-lm.

Each module's ModelArgs is filled generically (``models.tiny_any``), with
OVERRIDES where a module needs specific values and VARIANTS for configurations
its default one leaves out. A module the filler cannot build, or whose own mlx-lm forward fails on the CPU, is
skipped with its reason; every other one must be refused by ``Engine()`` with
a ValueError naming its architecture, or give mlx-lm's greedy tokens for two
concurrent prompts crossing block boundaries in chunked prefills.

With mlx-lm 0.32.2: 106 exact (MLA, sliding-window, softcapped and hybrid recurrent models among them), 20 refused (4 wrong
logits (plamo, plamo3, iquestloopcoder, gemma4[kv-shared]), 4 MLA beside recurrent layers (bailing_hybrid, kimi_k3,
kimi_linear, longcat_flash_ngram), 3 no attention layers (mamba, mamba2, rwkv7), 2 arange RoPE positions
(gpt_bigcode, llama4), 2 sparse attention (deepseek_v32, glm_moe_dsa), 1 no scaled_dot_product_attention (plamo2),
1 a cache of its own (deepseek_v41), 1 cache not passed to it (phi3small), 1 failing on the paged cache
(afm7), 1 a layer storing no K/V (nemotron-nas)),
3 skipped (``pytest -rs`` shows the reasons):
- ModelArgs not filled generically: olmo (its module exits without the ai2-olmo package).
- mlx-lm's own forward fails on the CPU: bitnet and muse_spark (Metal kernels).
"""

import pytest
from models import LAYERS, Unfillable, model_modules, nested_config, tiny_any
from test_engine import random_prompts, reference

from llm_paged_mlx import Engine, SamplingParams
from llm_paged_mlx.models.adapt import architecture

# What the generic filler cannot guess, by module.
OVERRIDES = {
    "phi3small": dict(vocab_size=100352),  # its logits mask writes to token ids up to 100351
    "deepseek_v2": dict(rope_scaling={"factor": 1.0}),  # its YaRN RoPE reads rope_scaling unconditionally
    "minicpm3": dict(rope_scaling={}),  # its LongRoPE reads rope_scaling unconditionally (with defaults for keys)
    "hunyuan": dict(rope_scaling={"alpha": 1.0, "factor": 1.0, "type": "dynamic"}),  # its NTK RoPE reads alpha
    "exaone4": dict(sliding_window_pattern="LG"),  # a str: L (local) or G (global) per layer
    # Layer stacks in each model's own words: a recurrent, linear or sliding layer, then full attention.
    "olmo3": dict(layer_types=["sliding_attention", "full_attention"]),
    "gemma3n": dict(text_config={**nested_config("gemma3n"), "layer_types": ["sliding_attention", "full_attention"]}),
    "granitemoehybrid": dict(layer_types=["mamba", "attention"]),
    "olmo_hybrid": dict(layer_types=["linear_attention", "full_attention"]),
    "nemotron_h": dict(layer_types=["linear_attention", "full_attention"]),
    "recurrent_gemma": dict(block_types=["recurrent", "attention"]),
    "lfm2": dict(layer_types=["conv", "full_attention"]),
    "lfm2_moe": dict(layer_types=["conv", "full_attention"]),
    "lfm2-vl": dict(text_config={**nested_config("lfm2"), "layer_types": ["conv", "full_attention"]}),
    "nemotron-nas": dict(  # the blocks Nemotron-NAS mixes: GQA, no attention, a linear layer instead of attention
        num_hidden_layers=3,
        block_configs=[
            {"attention": {"n_heads_in_group": 2}, "ffn": {"ffn_mult": 1.0}},
            {"attention": {"no_op": True}, "ffn": {"ffn_mult": 1.0}},
            {"attention": {"replace_with_linear": True}, "ffn": {"replace_with_linear": True}},
        ],
    ),
    # It asserts top-1 routing, and builds the global-attention mask of layer 3 (every fourth layer is global).
    "llama4": dict(text_config={**nested_config("llama4"), "num_experts_per_tok": 1, "num_hidden_layers": 4}),
    "kimi_k3": dict(text_config={**nested_config("kimi_k3"), "hidden_act": "situ"}),  # the only activation it has
    "muse_spark": dict(text_config={**nested_config("muse_spark"), "num_shared_experts": 0}),  # it raises on any
    "minimax_m3_vl": dict(text_config={**nested_config("minimax_m3_vl"), "moe_layer_freq": [1] * LAYERS}),  # a list
    "prism_hadamard_qwen35": dict(  # a text-only pack with one packed 2-bit layer (whose weights are zeros)
        schema_version=1, tensor_namespace="mlx-lm-text", quantization={"bits": 2, "group_size": 128, "mode": "affine"},
        modules=[{"path": "model.layers.1.self_attn.o_proj", "embedding": False, "dtype": "float16", "block": 0}],
    ),
}
# Configurations of a module that its default one leaves out.
VARIANTS = {
    "mistral3[mistral4]": ("mistral3", dict(text_config=nested_config("mistral4"))),  # another text model
    # Layers that attend with an earlier layer's K/V: cross-layer attention (as Hunyuan-Large), and Gemma 4's
    # KV-shared last layers (as its small models).
    "hunyuan[cla]": ("hunyuan", dict(OVERRIDES["hunyuan"], use_cla=True)),
    "gemma4[kv-shared]": ("gemma4", dict(text_config={**nested_config("gemma4"), "num_kv_shared_layers": 1})),
}
PROMPTS = random_prompts([20, 37], seed=11)  # across the block boundaries at 16 and 32
MAX_TOKENS = 5


@pytest.mark.parametrize("name", model_modules() + list(VARIANTS))
def test_the_engine_refuses_the_model_or_gives_mlx_lm_tokens(name):
    arch, overrides = VARIANTS.get(name, (name, OVERRIDES.get(name, {})))
    try:
        model = tiny_any(arch, **overrides)
    except Unfillable as e:
        pytest.skip(f"{name}: ModelArgs not filled generically: {e}")
    except (Exception, SystemExit) as e:  # olmo's module exits when ai2-olmo is missing
        pytest.skip(f"{name}: ModelArgs not filled generically: {type(e).__name__}: {e}")
    try:
        expected = [reference(model, prompt, MAX_TOKENS) for prompt in PROMPTS]
    except Exception as e:
        pytest.skip(f"{name}: mlx-lm's own forward fails on the CPU: {type(e).__name__}: {e}")
    try:
        engine = Engine(model, block_size=16, num_blocks=12, max_num_batched_tokens=24)
    except ValueError as e:
        print(f"{name}: refused: {e}")
        assert str(e).startswith(f"{architecture(model)}: ")
        return
    outputs = engine.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS))
    assert [o.token_ids for o in outputs] == expected
    assert engine.stats()["free_blocks"] == 11
    print(f"{name}: exact")
