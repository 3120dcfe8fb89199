"""EngineConfig: every option's default defined once, bad values named, and the plugin's options built on it."""

import dataclasses
import pickle

import pytest

from llm_paged_mlx import Engine
from llm_paged_mlx.engine.config import EngineConfig
from llm_paged_mlx.options import DEFAULT_KV_DISK_BUDGET, PagedOptions, serving_config

from models import tiny_model


def test_an_engine_built_without_options_has_the_config_s_defaults():
    engine = Engine(tiny_model("llama"), num_blocks=16)
    assert engine.config == EngineConfig(num_blocks=16)
    assert engine.blocks.block_size == EngineConfig.block_size
    assert engine.scheduler.max_num_batched_tokens == EngineConfig.max_num_batched_tokens


def test_a_config_and_keyword_options_over_it():
    base = EngineConfig(block_size=8, num_blocks=32)
    engine = Engine(tiny_model("llama"), None, base, max_num_batched_tokens=64)
    assert engine.config == base.replace(max_num_batched_tokens=64)
    assert engine.blocks.block_size == 8 and engine.scheduler.max_num_batched_tokens == 64


def test_the_plugin_s_defaults_are_the_engine_s_but_for_the_budget():
    config = serving_config(PagedOptions())
    assert config.engine == EngineConfig(kv_budget_bytes="auto")
    assert (config.kv_disk_budget, config.draft_model) == (DEFAULT_KV_DISK_BUDGET, None)
    given = serving_config(PagedOptions(block_size=8, kv_budget="1GB", prefix_cache=False, kv_disk_budget=0))
    assert given.engine == EngineConfig(block_size=8, kv_budget_bytes=1 << 30, enable_prefix_caching=False)
    assert given != config and given.kv_disk_budget == 0  # another config: the loop builds another engine
    assert pickle.loads(pickle.dumps(given)) == given  # as rank 0 sends it to the other ranks


@pytest.mark.parametrize("field, option", [("block_size", "block_size"), ("max_num_batched_tokens", "max_num_batched_tokens"),
                                           ("kv_group_size", "kv_group_size"), ("num_speculative_tokens", "num_speculative_tokens")])  # fmt: skip
def test_the_options_help_names_the_config_s_default(field, option):
    assert f"default {getattr(EngineConfig, field)}" in PagedOptions.model_fields[option].description


@pytest.mark.parametrize(
    "options, message",
    [
        (dict(block_size=0), "block_size must be a positive integer, got 0"),
        (dict(max_num_batched_tokens=0), "max_num_batched_tokens must be a positive integer, got 0"),
        (dict(max_num_seqs=2.5), r"max_num_seqs must be a positive integer or None, got 2.5"),
        (dict(num_blocks="10"), r"num_blocks must be an integer of at least 2 \(one is the null block\), or None, got '10'"),
        (dict(kv_budget_bytes=True), "kv_budget_bytes must be a positive number of bytes, 'auto' or None, got True"),
        (dict(memory_fraction=float("nan")), r"memory_fraction must be in \(0, 1\], got nan"),
        (dict(enable_prefix_caching="no"), "enable_prefix_caching must be True or False, got 'no'"),
        (dict(scheduler=None), "scheduler must be a name, got None"),
        (dict(speculative="eagle"), "unknown speculative mode 'eagle': choose from ngram, draft"),
        (dict(num_speculative_tokens=17), "num_speculative_tokens must be an integer from 1 to 16, got 17"),
        (dict(speculative_max_batch=True), "speculative_max_batch must be a positive integer, got True"),
    ],
)
def test_a_bad_value_is_refused_by_name(options, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(**options)
    with pytest.raises(ValueError, match=message):
        Engine(tiny_model("llama"), **{"num_blocks": 16, **options})


def test_an_unknown_option_is_named_and_a_config_is_frozen():
    with pytest.raises(TypeError, match="unknown engine option.*: blocksize"):
        Engine(tiny_model("llama"), blocksize=8)
    with pytest.raises(dataclasses.FrozenInstanceError):
        EngineConfig().block_size = 8
    with pytest.raises(TypeError, match="config must be an EngineConfig, not a dict"):
        Engine(tiny_model("llama"), None, {"block_size": 8})


def test_the_code_path_leaves_out_what_only_sizes_or_serves():
    config = EngineConfig()
    assert config.replace(kv_budget_bytes=1 << 20, max_num_seqs=4, scheduler="priority").code_path == config.code_path
    assert config.replace(attention_kernel="portable").code_path == config.code_path  # the selected kernel counts
    assert EngineConfig(memory_fraction=1) == EngineConfig(memory_fraction=1.0)
    assert repr(EngineConfig(memory_fraction=1)) == repr(EngineConfig(memory_fraction=1.0))  # what ranks compare
    assert config.replace(block_size=8).code_path != config.code_path
    assert config.replace(kv_bits=4).code_path == config.code_path  # quantized K/V are checked at full precision


def test_serve_refuses_what_the_engine_s_config_refuses_before_any_rank_starts():
    from llm_paged_mlx.cli import _parse_options

    with pytest.raises(ValueError, match="num_speculative_tokens must be an integer from 1 to 16, got 17"):
        _parse_options({"speculative": "ngram", "num_speculative_tokens": "17"})
