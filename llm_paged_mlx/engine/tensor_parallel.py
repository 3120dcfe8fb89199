"""Tensor parallelism over ``mx.distributed``: one model sharded over a group of processes (ranks).

The weights are sharded by mlx-lm's own ``Model.shard(group)``: each rank
keeps its share of the attention heads (and so a paged pool of its own K/V
heads) and of the MLP, and the layers sum their outputs over the group. Every
rank runs the same engine on the same requests in the same order, so their
schedulers make the same decisions; what could differ between ranks is agreed
here: the tokens a step samples (rank 0's) and an ``"auto"`` KV budget (the
smallest).
"""

import mlx.core as mx

from ..models.paged_cache import architecture, model_config


def shard_model(model, group: mx.distributed.Group) -> None:
    """Shard ``model`` in place over ``group``; ValueError if mlx-lm cannot shard its architecture or its heads
    do not divide by the group's size."""
    size, name = group.size(), architecture(model)
    if not hasattr(model, "shard"):
        raise ValueError(f"{name}: mlx-lm cannot shard this architecture over devices (its model has no shard())")
    config = model_config(model)
    for field in ("num_attention_heads", "num_key_value_heads"):
        heads = getattr(config, field, None)
        if heads is not None and heads % size:
            raise ValueError(f"{name}: its {heads} {field.replace('num_', '').replace('_', ' ')} do not divide "
                             f"over {size} devices")  # fmt: skip
    model.shard(group)
    mx.eval(model.parameters())


def rank_zero_tokens(tokens: mx.array, group: mx.distributed.Group) -> mx.array:
    """Rank 0's ``tokens`` on every rank (lazy): the others' own draws may differ."""
    mine = tokens.astype(mx.int32) * int(group.rank() == 0)
    return mx.distributed.all_sum(mine, group=group).astype(tokens.dtype)


def smallest_of_ranks(value: int, group: mx.distributed.Group) -> int:
    """The smallest of every rank's ``value`` (a count of MiB or fewer: it travels as int32)."""
    values = mx.zeros(group.size(), dtype=mx.int32).at[group.rank()].add(value)
    return int(mx.distributed.all_sum(values, group=group).min().item())
