"""Tensor parallelism over ``mx.distributed``: one model sharded over a group of processes (ranks).

The weights are sharded by mlx-lm's own ``Model.shard(group)``: each rank
keeps its share of the attention heads (and so a paged pool of its own K/V
heads) and of the MLP, and the layers sum their outputs over the group. Every
rank runs the same engine on the same requests in the same order, so their
schedulers make the same decisions; what could differ between ranks is agreed
here: the tokens a step samples (rank 0's) and an ``"auto"`` KV budget (the
smallest, shared by the ranks on one machine when they share its memory). The
engines' options are compared when they are built; the requests are not
(every rank must submit the same ones).
"""

import hashlib
import socket

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from ..models.adapt import architecture, model_config


SHARDED = (nn.AllToShardedLinear, nn.ShardedToAllLinear, nn.QuantizedAllToShardedLinear, nn.QuantizedShardedToAllLinear)


def is_sharded(model) -> bool:
    """Whether ``model`` has layers sharded over a group (by ``Model.shard``)."""
    return any(isinstance(module, SHARDED) for _, module in model.named_modules())


def shard_model(model, group: mx.distributed.Group) -> None:
    """Shard ``model`` in place over ``group``; ValueError if mlx-lm cannot shard it: its architecture has no
    ``shard()``, its heads (or other sizes) do not divide by the group's size."""
    size, name = group.size(), architecture(model)
    check_shardable(model, size)
    try:
        model.shard(group)
    except (ValueError, AssertionError, AttributeError) as e:  # sizes mlx-lm checks as it goes, or its own bugs
        raise ValueError(f"{name}: mlx-lm cannot shard it over {size} devices ({e}); the model is left "
                         "partly sharded")  # fmt: skip
    for _, weights in tree_flatten(model.parameters()):  # lazy weights: one whole tensor at a time, then its shard
        mx.eval(weights)


def check_shardable(model, size: int) -> None:
    """ValueError if ``model`` (its weights may still be lazy) cannot be sharded over ``size`` devices: its
    architecture has no ``shard()``, or its heads do not divide by ``size``."""
    name = architecture(model)
    if not hasattr(model, "shard"):
        raise ValueError(f"{name}: mlx-lm cannot shard this architecture over devices (its model has no shard())")
    config = model_config(model)
    for config in (config, getattr(config, "text_config", None)):
        for field in ("num_attention_heads", "num_key_value_heads"):
            heads = config.get(field) if isinstance(config, dict) else getattr(config, field, None)
            if isinstance(heads, int) and heads % size:
                raise ValueError(f"{name}: its {heads} {field.replace('num_', '').replace('_', ' ')} do not divide "
                                 f"over {size} devices")  # fmt: skip


def check_same_config(config, group: mx.distributed.Group) -> None:
    """ValueError unless every rank's engine was given the same ``config`` (an ``EngineConfig``: its ``repr``):
    ranks that decide differently would wait on each other for good."""
    if len(set(every_rank(_digest(repr(config)), group))) > 1:
        raise ValueError("the ranks of a tensor-parallel engine were given different options: every rank must "
                         "build the same engine")  # fmt: skip


def ranks_on_this_machine(group: mx.distributed.Group) -> int:
    """How many of the group's ranks run on this machine (its host name)."""
    host = _digest(socket.gethostname())
    return every_rank(host, group).count(host)


def rank_zero_tokens(tokens: mx.array, group: mx.distributed.Group) -> mx.array:
    """Rank 0's ``tokens`` on every rank (lazy): the others' own draws may differ."""
    mine = tokens.astype(mx.int32) * int(group.rank() == 0)
    return mx.distributed.all_sum(mine, group=group).astype(tokens.dtype)


def every_rank(value: int, group: mx.distributed.Group) -> list[int]:
    """Each rank's ``value`` (an int32), in rank order, on every rank."""
    values = mx.zeros(group.size(), dtype=mx.int32).at[group.rank()].add(value)
    return mx.distributed.all_sum(values, group=group).tolist()


def _digest(text: str) -> int:
    """24 bits of ``text``'s SHA-256: an int32 to compare across ranks."""
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:3], "little")
