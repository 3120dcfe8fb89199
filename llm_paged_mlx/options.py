"""The plugin's model options (``-o key value``), and what they ask of the engine and the sampler."""

import re
from dataclasses import dataclass
from typing import Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from .engine.config import DEFAULT_MAX_NUM_SEQS, MAX_SPECULATIVE_TOKENS, EngineConfig

DEFAULTS = EngineConfig()
DEFAULT_MAX_TOKENS = 1024
DEFAULT_KV_DISK_BUDGET = 4 * 1024**3

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "k": 1024, "m": 1024**2, "g": 1024**3, "t": 1024**4}


def parse_size(value) -> int:
    """Bytes from an int or a string such as "512MB", "2GB" or "1.5GiB" (units of 1024)."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    match = _SIZE.match(str(value))
    if not match:
        raise ValueError(f"{value!r} is not a size: use bytes or a number with KB, MB or GB")
    number, unit, _ = match.groups()
    return int(float(number) * _UNITS[unit.lower()])


class PagedOptions(BaseModel):
    """The options ``llm -m MODEL -o key value`` and ``llm paged-mlx serve -o key value`` take (as llm's
    ``Options``: unknown keys are refused)."""

    model_config = ConfigDict(extra="forbid")

    max_tokens: Optional[int] = Field(
        None, gt=0, description=f"Maximum number of tokens to generate (default {DEFAULT_MAX_TOKENS})"
    )
    # inf and nan are no sampling parameters: allow_inf_nan=False names them (a bound alone would let inf by)
    temperature: Optional[float] = Field(
        None, ge=0, le=2, allow_inf_nan=False, description="Sampling temperature from 0 to 2; 0 (the default) is greedy"
    )
    top_p: Optional[float] = Field(
        None, gt=0, le=1, allow_inf_nan=False,
        description="Nucleus sampling: keep the top tokens up to this probability mass",
    )
    top_k: Optional[int] = Field(None, ge=0, description="Sample from the k most likely tokens only (0: no limit)")
    min_p: Optional[float] = Field(
        None, ge=0, le=1, allow_inf_nan=False,
        description="Drop tokens less likely than min_p times the most likely one",
    )
    seed: Optional[int] = Field(None, description="Random seed, for repeatable sampling")
    stop: Optional[str] = Field(None, min_length=1, description="Stop generating when this string appears")
    block_size: Optional[int] = Field(None, ge=1, le=1024, description=f"Tokens per KV cache block (default {DEFAULTS.block_size})")
    kv_budget: Optional[Union[int, Literal["auto"]]] = Field(
        None,
        description="KV cache size: auto (the default: what the device's memory leaves), or bytes, or with a unit such as 512MB or 2GB",
    )
    memory_fraction: Optional[float] = Field(
        None, gt=0, le=1, description="With kv_budget auto: the share of the device's memory to use in all "
        f"(default {DEFAULTS.memory_fraction})"
    )
    kv_bits: Optional[Literal[8, 4]] = Field(
        None, description="Store the KV cache quantized in 8 or 4 bits: about 1.9x or 3.5x the context in the same memory "
        "(greedy answers may then differ slightly between a cached and an uncached prompt)"
    )
    kv_group_size: Optional[Literal[32, 64, 128]] = Field(
        None, description=f"Values per scale and bias of a quantized KV cache (default {DEFAULTS.kv_group_size})"
    )
    scheduler: Optional[str] = Field(None, description=f"Scheduling policy: {DEFAULTS.scheduler} (default), priority, or one a plugin adds")
    attention_kernel: Optional[str] = Field(None, description=f"Paged attention kernel: {DEFAULTS.attention_kernel} (default), portable, metal, cuda, or one a plugin adds")
    prefix_cache: Optional[bool] = Field(None, description=f"Reuse the KV of earlier prompts' common prefix (default {str(DEFAULTS.enable_prefix_caching).lower()})")
    kv_disk_budget: Optional[int] = Field(
        None, ge=0, description=f"Disk space for KV blocks kept across processes, e.g. {DEFAULT_KV_DISK_BUDGET >> 30}GB (the default); 0 turns it off"
    )
    max_num_seqs: Optional[int] = Field(
        None, ge=1, description=f"Most requests decoded together in one step (default {DEFAULT_MAX_NUM_SEQS}, fewer for hybrid models whose recurrent state would fill half the budget); raise it to serve many clients at once"
    )
    max_num_batched_tokens: Optional[int] = Field(
        None, ge=1, description=f"Most tokens (prompt chunks and decoded tokens) in one step (default {DEFAULTS.max_num_batched_tokens})"
    )
    speculative: Optional[Literal["ngram"]] = Field(
        None, description="Speculative decoding: ngram drafts the answer's next tokens from the prompt and the answer "
        "so far (prompt lookup) and checks them in one step: the same answer, faster where it repeats its input"
    )
    draft_model: Optional[str] = Field(
        None, min_length=1, description="Speculative decoding with this draft model of the same vocabulary (one of "
        "this plugin's model ids, an mlx-lm folder or a Hugging Face repo): it drafts tokens that each step checks"
    )
    num_speculative_tokens: Optional[int] = Field(
        None, ge=1, description="With speculative or draft_model: the most tokens drafted a step "
        f"(default {DEFAULTS.num_speculative_tokens}, up to {MAX_SPECULATIVE_TOKENS})"
    )
    tensor_parallel: Optional[int] = Field(
        None, ge=1, description="Shard the model over this many processes on this machine, one per GPU (NVIDIA: nccl; "
        "elsewhere: ring); the first prompt starts them. No KV disk tier then"
    )

    @model_validator(mode="after")
    def _speculative_given(self):
        if self.num_speculative_tokens is not None and self.speculative is None and self.draft_model is None:
            raise ValueError("num_speculative_tokens needs speculative or draft_model (e.g. -o speculative ngram)")
        if self.speculative is not None and self.draft_model is not None:
            raise ValueError("speculative ngram drafts without a model: give it or draft_model, not both")
        return self

    @field_validator("kv_budget", mode="before")
    @classmethod
    def _parse_budget(cls, value):
        if isinstance(value, str) and value.strip().lower() == "auto":
            return "auto"
        return None if value is None else parse_size(value)

    @field_validator("kv_disk_budget", mode="before")
    @classmethod
    def _parse_size(cls, value):
        return None if value is None else parse_size(value)

    @field_validator("kv_budget")
    @classmethod
    def _positive(cls, value):
        if isinstance(value, int) and value <= 0:
            raise ValueError("kv_budget must be positive")
        return value

    @field_validator("kv_bits", "kv_group_size", mode="before")
    @classmethod
    def _number(cls, value):
        return int(value) if isinstance(value, str) and value.isdigit() else value

    @field_validator("scheduler")
    @classmethod
    def _known_scheduler(cls, value):
        from . import plugins

        if value is not None:
            plugins.lookup("scheduler", plugins.schedulers(), value)  # ValueError names the known ones
        return value

    @field_validator("attention_kernel")
    @classmethod
    def _known_kernel(cls, value):
        from . import plugins

        if value not in (None, "auto"):
            plugins.lookup("attention kernel", plugins.attention_kernels(), value)
        return value


@dataclass(frozen=True)
class ServingConfig:
    """What a model's engine loop builds an engine with: the engine's config, the disk tier's budget (0: none)
    and the draft model (one of this plugin's ids, a folder or a repo)."""

    engine: EngineConfig
    kv_disk_budget: int = DEFAULT_KV_DISK_BUDGET
    draft_model: Optional[str] = None


# Engine options as the plugin names them, where the names differ
_ENGINE_NAMES = {"kv_budget": "kv_budget_bytes", "prefix_cache": "enable_prefix_caching"}
_ENGINE_OPTIONS = ("block_size", "kv_budget", "memory_fraction", "kv_bits", "kv_group_size", "scheduler",
                   "attention_kernel", "prefix_cache", "max_num_seqs", "max_num_batched_tokens", "speculative",
                   "num_speculative_tokens")  # fmt: skip


def serving_config(options: PagedOptions) -> ServingConfig:
    """The engine the options ask for: ``EngineConfig``'s defaults where they are not given, but with the
    budget ``"auto"`` (what the device's memory leaves)."""
    given = {_ENGINE_NAMES.get(name, name): getattr(options, name) for name in _ENGINE_OPTIONS}
    engine = EngineConfig(**{"kv_budget_bytes": "auto", **{k: v for k, v in given.items() if v is not None}})
    disk_budget = DEFAULT_KV_DISK_BUDGET if options.kv_disk_budget is None else options.kv_disk_budget
    return ServingConfig(engine, disk_budget, options.draft_model)


def sampling_params(options: PagedOptions, json_schema: Optional[dict] = None):
    """The request's sampling, from its options and (``--schema``) the JSON schema its output must fit."""
    from .engine.request import SamplingParams

    given = {
        name: getattr(options, name)
        for name in ("temperature", "top_p", "top_k", "min_p", "seed")
        if getattr(options, name) is not None
    }
    stop = [options.stop] if options.stop else None
    return SamplingParams(
        max_tokens=options.max_tokens or DEFAULT_MAX_TOKENS, stop=stop, json_schema=json_schema, **given
    )
