"""Tiny random-weight mlx-lm models for tests."""

import copy
import dataclasses
import importlib
import pkgutil

import mlx.core as mx
import mlx_lm.models
from mlx.utils import tree_flatten

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


# -- any mlx-lm architecture, filled generically ------------------------------------------------

# Modules of mlx_lm.models that hold no model of their own.
NOT_MODELS = {
    "activations", "base", "bitlinear_layers", "cache", "gated_delta", "mla", "pipeline", "rope_utils", "ssm",
    "switch_layers",
}

LAYERS = 2
MAX_PARAMETERS = 20_000_000
_DEFAULT_ROPE = {
    "rope_theta": 10000.0, "rope_type": "default", "type": "default", "factor": 1.0,
    "original_max_position_embeddings": 4096, "llama_4_scaling_beta": 0.0,
}
ROPE = {**_DEFAULT_ROPE, "full_attention": _DEFAULT_ROPE, "sliding_attention": _DEFAULT_ROPE}  # flat or per layer type
# Sizes, set wherever a ModelArgs has the field (their defaults are full-size models).
SIZES = dict(
    hidden_size=128, n_embd=128, d_model=128, model_dim=128, block_dim=128, hidden_dim=128,
    num_hidden_layers=LAYERS, n_layer=LAYERS, n_layers=LAYERS, num_layers=LAYERS, num_transformer_layers=LAYERS,
    intermediate_size=128, ffn_hidden_size=128, ff_intermediate_size=128, n_inner=128, intermediate_size_mlp=128,
    dense_intermediate_size=128, moe_intermediate_size=64, expert_ffn_hidden_size=64, moe_hidden_size=64,
    shared_intermediate_size=64, shared_expert_intermediate_size=64, share_expert_dim=64,
    num_attention_heads=4, n_head=4, n_heads=4, num_heads=4,
    num_key_value_heads=2, n_kv_heads=2, num_kv_heads=2, kv_n_heads=2, num_attention_groups=2, n_shared_head=2,
    head_dim=32, kv_channels=32, rotary_dim=16, vocab_size=256,
    vocab_size_per_layer_input=256, hidden_size_per_layer_input=16,
    max_position_embeddings=4096, n_positions=4096, n_ctx=4096, model_max_length=4096,
    num_experts=4, num_local_experts=4, n_routed_experts=4, moe_num_experts=4,
    num_experts_per_tok=2, num_experts_per_token=2, moe_topk=2, moe_top_k=2,
    n_group=1, n_groups=1, topk_group=1,
    kv_lora_rank=32, q_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=32,
    sliding_window=64, sliding_window_pattern=2, sliding_window_size=64, rope_theta=10000.0, rope_parameters=ROPE,
    global_head_dim=32, swa_head_dim=32, swa_v_head_dim=32, swa_num_attention_heads=4, swa_num_key_value_heads=2,
    laurel_rank=8, num_kv_shared_layers=0,
    # Recurrent and linear-attention layers (Mamba, gated delta nets, short convolutions, RWKV).
    state_size=16, ssm_state_size=16, mamba_d_state=16, mamba_num_heads=4, mamba_n_heads=4, mamba_head_dim=32,
    mamba_d_head=32, mamba_d_ssm=128, mamba_n_groups=1, mamba_d_conv=4, mamba_expand=2, conv_kernel=4, conv_L_cache=3,
    conv1d_width=4, time_step_rank=8, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32,
    linear_value_head_dim=32, linear_conv_kernel_dim=4, a_low_rank_dim=16, v_low_rank_dim=16,
    gate_low_rank_dim=16, decay_low_rank_dim=16,
    full_attention_interval=LAYERS,  # the last layer attends, the ones before it are linear
)
# Values for required fields (and for nested configs), by name.
REQUIRED = dict(
    rms_norm_eps=1e-5, layer_norm_eps=1e-5, layer_norm_epsilon=1e-5, norm_eps=1e-5, rotary_emb_base=10000,
    hidden_act="silu", tie_word_embeddings=True, attention_bias=False, mlp_bias=False, use_qk_norm=False,
    layer_types=["full_attention"] * LAYERS, rope_scaling=None, partial_rotary_factor=0.5, rotary_pct=0.5,
    first_k_dense_replace=1, decoder_sparse_step=1, moe_layer_freq=1, norm_topk_prob=True, routed_scaling_factor=1.0,
    mlp_only_layers=[], sliding_window_layers=[], attention_window_size=64,
    num_kv_reuse_layers=1, dense_attention_every_n_layers=1, gegelu_limit=20.0, n_shared_experts=1,
    num_shared_experts=1, dim_model_base=128, scale_depth=1.0, scale_emb=1.0, clip_qkv=8.0, conv_window=2,
    block_size=4096, layer_group_size=2, group_norm_size=1, num_dense_layers=1, index_head_dim=32, index_n_heads=2,
    index_topk=8, topk_method="noaux_tc", scoring_func="sigmoid", num_shared_expert=1, cla_share_factor=2,
    attention_chunk_size=64, interleave_moe_layer_step=1, zero_expert_num=1, zero_expert_type="identity",
    attention_method="MLA", final_logit_softcapping=30.0, logits_soft_cap=30.0, rope_local_base_freq=10000.0,
    post_norm_eps=1e-5, output_multiplier=1.0, swa_rope_theta=10000.0, ffn_dim_divisor=32, ffn_multipliers=1.0,
    num_query_heads=4, time_step_limit=(0.001, 100.0),
    mla_scale_q_lora=True, mla_scale_kv_lora=True,  # False leaves longcat_flash's scales unset, yet it reads them
    no_rope_layers=[1] * (LAYERS - 1) + [0],  # 1 marks a layer with RoPE (llama4_text)
    # Hybrid layer stacks: the last layer attends fully, the ones before it are recurrent, linear or sliding.
    attn_layer_period=LAYERS, attn_layer_offset=LAYERS - 1, expert_layer_period=LAYERS, expert_layer_offset=LAYERS - 1,
    hybrid_layer_pattern=[1] * (LAYERS - 1) + [0],  # 1 marks a sliding-window layer
    linear_attn_config=dict(  # its layer numbers count from 1
        kda_layers=list(range(1, LAYERS)), full_attn_layers=[LAYERS], num_heads=4, head_dim=32,
        short_conv_kernel_size=4,
    ),
    # Read from nested configs (where no field type says what an unknown name is).
    conv_bias=False, block_multiple_of=32, block_ffn_dim_multiplier=1.0, block_auto_adjust_ff_dim=False,
    activation_sparsity_pattern=[0.0] * LAYERS, altup_num_inputs=2, altup_coef_clip=120.0, altup_correct_scale=True,
    altup_active_idx=0, layer_rope_theta=[10000.0] * LAYERS,
)


class Unfillable(Exception):
    """A ModelArgs field this generic filler has no value for."""


def model_modules() -> list[str]:
    """The model modules of the installed mlx-lm."""
    return [m.name for m in pkgutil.iter_modules(mlx_lm.models.__path__) if m.name not in NOT_MODELS]


def nested_config(model_type: str) -> dict:
    """A nested config (text_config, ffn_config, ...): whoever reads it takes the names it knows."""
    return {**SIZES, **REQUIRED, **ROPE, "model_type": model_type}


def _value(field, arch):
    """A small value for a required field, by its name and type."""
    if field.name in REQUIRED:
        return copy.deepcopy(REQUIRED[field.name])
    if field.name == "model_type":
        return arch
    kind = str(field.type).lower()
    if "dict" in kind:
        return nested_config(arch)
    if "bool" in kind:
        return False
    if "float" in kind:
        return 1.0
    raise Unfillable(f"no generic value for {field.name}: {field.type}")


def tiny_args(arch: str, **overrides):
    """``arch``'s ModelArgs with small sizes, required fields filled by name and type."""
    module = importlib.import_module(f"mlx_lm.models.{arch}")
    config = {}
    for field in dataclasses.fields(module.ModelArgs):
        required = field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING
        if field.name in SIZES:
            config[field.name] = SIZES[field.name]
        elif field.name == "text_config":
            config[field.name] = nested_config(arch)
        elif required:
            config[field.name] = _value(field, arch)
        else:
            continue
        if "list" in str(field.type).lower() and not isinstance(config[field.name], list):
            config[field.name] = [config[field.name]] * LAYERS  # a value per layer
    config.update(overrides)
    return module.ModelArgs(**config)


def tiny_any(arch: str, seed: int = 0, **overrides):
    """A small random-weight model of any mlx-lm architecture (raises Unfillable if the filler cannot)."""
    module = importlib.import_module(f"mlx_lm.models.{arch}")
    args = tiny_args(arch, **overrides)
    mx.random.seed(seed)
    model = module.Model(args)
    size = sum(p.size for _, p in tree_flatten(model.parameters()))  # not evaluated yet: no memory taken
    if size > MAX_PARAMETERS:
        raise Unfillable(f"{size} parameters: some size of it is not in SIZES")
    mx.eval(model.parameters())
    return model
