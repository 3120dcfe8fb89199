"""What an engine refuses before it builds anything: a model or options that the ranks of a tensor-parallel
group cannot share or would decide differently on, models whose attention the kernel cannot serve, and
speculative decoding where verified drafts would not give the tokens decoding gives."""

from typing import Optional

from ..models.merged_projections import has_merged_projections
from ..models.adapt import architecture, check_model, model_config
from ..models.paged_cache import LayerLayout
from ..models.softcapped import has_softcapped_attention
from ..parallel.collectives import is_sharded
from .speculative import Speculator, check_options


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


def check_kernel(kernel, model, layouts) -> None:
    """ValueError naming what the model's attention ``layouts`` need that ``kernel`` does not do: multi-head
    latent attention, sliding windows, softcapped scores."""
    needs = [
        (any(layout.latent for layout in layouts) and not hasattr(kernel, "latent_attention"),
         "has no latent_attention, which multi-head latent attention (MLA) needs"),
        (any(layout.window for layout in layouts) and not getattr(kernel, "windowed", False),
         "does not take a window, which the model's sliding-window layers need"),
        (has_softcapped_attention(model) and not getattr(kernel, "softcapped", False),
         "does not take softcapped scores, which the model's attention needs"),
    ]  # fmt: skip
    for missing, what in needs:
        if missing:
            raise ValueError(f"{architecture(model)}: attention kernel {kernel.name!r} {what}")


def check_speculation(speculative, num_tokens, max_batch, draft_model, model, layouts, state_layouts, kv_bits,
                      group) -> tuple[Optional[Speculator], list]:  # fmt: skip
    """The speculator the options ask for (None: none) and the draft model's layouts ([]: none); ValueError
    for options out of range, or speculative decoding that would not be exact for this model (``layouts``,
    ``state_layouts``: its ``check_model``). A ``draft_model`` alone means ``speculative="draft"``."""
    speculative = "draft" if draft_model is not None and speculative is None else speculative
    check_options(speculative, num_tokens, max_batch)
    if (speculative == "draft") != (draft_model is not None):
        raise ValueError("a draft model goes with speculative='draft' (draft_model=MODEL sets it)")
    if speculative is None:
        return None, []
    if draft_model is not None and not hasattr(draft_model, "parameters"):
        raise ValueError(f"draft_model must be a loaded mlx-lm model (Engine.from_pretrained also takes a folder or "
                         f"repo), got {type(draft_model).__name__}")  # fmt: skip
    if state_layouts:
        raise ValueError(f"{architecture(model)}: speculative decoding cannot take back the recurrent state that "
                         "rejected draft tokens change; leave speculative unset for this model")  # fmt: skip
    if kv_bits is not None:
        raise ValueError("speculative decoding with kv_bits: draft tokens would attend to each other's K/V before "
                         "quantization, so answers could differ from decoding's; use one or the other")  # fmt: skip
    draft_layouts = _check_draft_model(draft_model, model, layouts, group) if draft_model is not None else []
    return Speculator(speculative, num_tokens, max_batch), draft_layouts


def _check_draft_model(draft_model, model, layouts, group) -> list:
    """The draft model's layouts (``check_model``); ValueError if it cannot draft for ``model`` (its
    attention ``layouts``) in one engine: each block holds both models' K/V for the same tokens."""
    if group is not None:
        raise ValueError("draft_model: a draft model is not sharded over a tensor-parallel group")
    if any(layout.window or layout.latent for layout in layouts):
        raise ValueError(f"draft_model: {architecture(model)}'s sliding-window or latent attention keeps blocks "
                         "a draft model would not share; use speculative='ngram'")  # fmt: skip
    draft_layouts = check_model(draft_model)
    if not all(isinstance(layout, LayerLayout) and not (layout.window or layout.latent) for layout in draft_layouts):
        raise ValueError(f"draft_model: {architecture(draft_model)} has sliding-window, latent or recurrent layers; "
                         "a draft model needs full attention in every layer")  # fmt: skip
    vocab, draft_vocab = (getattr(model_config(m), "vocab_size", None) for m in (model, draft_model))
    if vocab != draft_vocab or vocab is None:
        raise ValueError(f"draft_model: its vocabulary ({draft_vocab} tokens) is not the model's ({vocab})")
    return draft_layouts
