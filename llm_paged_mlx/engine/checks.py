"""What an engine refuses before it builds anything: a model or options that the ranks of a tensor-parallel
group cannot share or would decide differently on, models whose attention the kernel cannot serve, and
speculative decoding where verified drafts would not give the tokens decoding gives."""

from typing import Optional

from ..models.adapt import ModelSpec, check_model
from ..models.merged_projections import has_merged_projections
from ..parallel.collectives import is_sharded
from .config import EngineConfig
from .speculative import Speculator


def check_group(model, group, kv_disk_cache, scheduler: str, swap_policy: str) -> str:
    """ValueError for a model sharded or merged already, and, over a tensor-parallel ``group`` (None: one
    process), for options every rank cannot decide alike; the swap policy to use (``"auto"`` is
    ``"recompute"`` over a group)."""
    if is_sharded(model):
        raise ValueError("the model is already sharded over devices: give the unsharded model with "
                         "tensor_parallel=group, which shards it")  # fmt: skip
    if group is None:
        return swap_policy
    if has_merged_projections(model):
        raise ValueError("the model's projections were merged by an engine on one device: give the model as "
                         "loaded with tensor_parallel=group, which shards it")  # fmt: skip
    if kv_disk_cache is not None:
        raise ValueError("kv_disk_cache: the disk tier is not shared by the ranks of a tensor-parallel engine")
    if scheduler == "priority":
        raise ValueError("scheduler 'priority' ages requests by each rank's own clock: use 'fcfs' with "
                         "tensor_parallel")  # fmt: skip
    swap_policy = "recompute" if swap_policy == "auto" else swap_policy
    if swap_policy not in ("recompute", "cpu"):
        raise ValueError(f"swap_policy {swap_policy!r} may decide differently on each rank: use 'recompute' "
                         "or 'cpu' with tensor_parallel")  # fmt: skip
    return swap_policy


def check_kernel(kernel, spec: ModelSpec) -> None:
    """ValueError naming what the model (its ``spec``) needs that ``kernel`` does not do: multi-head latent
    attention, sliding windows, softcapped scores."""
    needs = [
        (spec.latent and kernel.latent_attention is None,
         "has no latent_attention, which multi-head latent attention (MLA) needs"),
        (spec.windowed and not kernel.windowed, "does not take a window, which the model's sliding-window layers need"),
        (spec.softcapped and not kernel.softcapped, "does not take softcapped scores, which the model's attention needs"),
    ]  # fmt: skip
    for missing, what in needs:
        if missing:
            raise ValueError(f"{spec.architecture}: attention kernel {kernel.name!r} {what}")


def check_speculation(config: EngineConfig, draft_model, spec: ModelSpec,
                      group) -> tuple[Optional[Speculator], Optional[ModelSpec]]:  # fmt: skip
    """The speculator ``config`` asks for (None: none) and the draft model's spec (None: none); ValueError
    for speculative decoding that would not be exact for this model (its ``spec``). A ``draft_model`` alone
    means ``speculative="draft"``."""
    speculative = config.speculative
    speculative = "draft" if draft_model is not None and speculative is None else speculative
    if (speculative == "draft") != (draft_model is not None):
        raise ValueError("a draft model goes with speculative='draft' (draft_model=MODEL sets it)")
    if speculative is None:
        return None, None
    if draft_model is not None and not hasattr(draft_model, "parameters"):
        raise ValueError(f"draft_model must be a loaded mlx-lm model (Engine.from_pretrained also takes a folder or "
                         f"repo), got {type(draft_model).__name__}")  # fmt: skip
    if spec.states:
        raise ValueError(f"{spec.architecture}: speculative decoding cannot take back the recurrent state that "
                         "rejected draft tokens change; leave speculative unset for this model")  # fmt: skip
    if config.kv_bits is not None:
        raise ValueError("speculative decoding with kv_bits: draft tokens would attend to each other's K/V before "
                         "quantization, so answers could differ from decoding's; use one or the other")  # fmt: skip
    draft_spec = _check_draft_model(draft_model, spec, group) if draft_model is not None else None
    return Speculator(speculative, config.num_speculative_tokens, config.speculative_max_batch), draft_spec


def _check_draft_model(draft_model, spec: ModelSpec, group) -> ModelSpec:
    """The draft model's spec (``check_model``); ValueError if it cannot draft for the model of ``spec`` in
    one engine: each block holds both models' K/V for the same tokens."""
    if group is not None:
        raise ValueError("draft_model: a draft model is not sharded over a tensor-parallel group")
    if spec.windowed or spec.latent:
        raise ValueError(f"draft_model: {spec.architecture}'s sliding-window or latent attention keeps blocks "
                         "a draft model would not share; use speculative='ngram'")  # fmt: skip
    draft = check_model(draft_model)
    if draft.states or draft.windowed or draft.latent:
        raise ValueError(f"draft_model: {draft.architecture} has sliding-window, latent or recurrent layers; "
                         "a draft model needs full attention in every layer")  # fmt: skip
    if spec.vocab_size != draft.vocab_size or spec.vocab_size is None:
        raise ValueError(f"draft_model: its vocabulary ({draft.vocab_size} tokens) is not the model's "
                         f"({spec.vocab_size})")  # fmt: skip
    return draft
