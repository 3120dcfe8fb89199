"""Test helper: one rank of a tensor-parallel engine run (started by tests/test_tensor_parallel.py).

    MLX_RANK=r MLX_HOSTFILE=hosts.json python tensor_parallel_rank.py CASE ARCH OUT

Every rank runs this same program, as ``mlx.launch`` would start it. It writes
what its engine gave (or the error it refused with) as JSON to ``OUT``.
"""

import json
import os
import sys

import mlx.core as mx
import mlx.nn as nn
from models import tiny_model
from smollm2 import smollm2_dir
from test_engine import random_prompts
from test_engine_smollm2 import chat
from test_speculative import repeating_prompts

from llm_paged_mlx import Engine, SamplingParams

LENGTHS = [40, 300, 120, 7, 64, 200]
SHARED = 48  # the first prompt's tokens that a later prompt starts with
MAX_TOKENS = 40


def requests():
    """Prompts (one repeats another's start, for the prefix cache) and their params: greedy, and sampled
    without a seed (each rank would draw its own tokens)."""
    prompts = random_prompts(LENGTHS)
    prompts.append(prompts[1][:SHARED] + prompts[0])
    params = [SamplingParams(max_tokens=MAX_TOKENS)] * len(prompts)
    params[2] = params[4] = SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0)
    return prompts, params


QUESTIONS = ["What is the capital of France?", "Name three colors.", "Why is the sky blue?"]
# Their prompts are 37, 34 and 36 tokens; the first two answers end by themselves (7 and 11 tokens), the third
# decodes across a block boundary (48, block_size 16) by its 13th token. No more: every step of 3 ranks on 2 cores
# makes ~60 collectives (two all_sums a layer).
SMOLLM2_TOKENS = 16


def smollm2(group, arch: str) -> dict:
    """SmolLM2's greedy answers, its 9 query and 3 KV heads sharded over the group (``arch``: unused)."""
    engine = Engine.from_pretrained(str(smollm2_dir()), tensor_parallel=group, kv_budget_bytes=64 << 20)
    prompts = [chat(engine.tokenizer, q) for q in QUESTIONS]
    outputs = engine.generate(prompts, SamplingParams(max_tokens=SMOLLM2_TOKENS))
    return {"tokens": [o.token_ids for o in outputs], "kv_heads": int(engine.model.layers[0].self_attn.n_kv_heads)}


def tiny(group, arch: str) -> dict:
    """A tiny model's tokens for ``requests()``, on a pool small enough to preempt."""
    model = tiny_model(arch)  # the same weights on every rank (it seeds MLX's generator)
    mx.random.seed(1000 + group.rank())  # then each rank its own draws, as separate processes have
    engine = Engine(model, num_blocks=40, max_num_batched_tokens=64, swap_policy="cpu", tensor_parallel=group)
    prompts, params = requests()
    outputs = engine.generate(prompts, params)
    stats = engine.stats()
    return {
        "tokens": [o.token_ids for o in outputs],
        "kv_heads": int(model.layers[0].self_attn.n_kv_heads),
        **{key: stats[key] for key in ("preemptions", "prefix_cache_hit_tokens", "free_blocks", "num_blocks")},
    }


def speculative(group, arch: str) -> dict:
    """Prompt lookup over the group: greedy and unseeded sampled requests that repeat their prompts."""
    model = tiny_model(arch)
    mx.random.seed(1000 + group.rank())
    engine = Engine(model, num_blocks=40, max_num_batched_tokens=64, tensor_parallel=group, speculative="ngram",
                    speculative_max_batch=8)  # fmt: skip
    prompts = repeating_prompts(6)
    params = [SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0 if i % 3 == 2 else 0.0) for i in range(6)]
    outputs = engine.generate(prompts, params)
    stats = engine.stats()
    keys = ("accepted_draft_tokens", "draft_tokens", "free_blocks", "num_blocks")
    return {"tokens": [o.token_ids for o in outputs], **{key: stats[key] for key in keys}}


def quantized(group, arch: str) -> dict:
    """A 4-bit tiny model's greedy tokens, and the classes of its sharded layers (which fold a step's rows)."""
    model = tiny_model(arch)
    nn.quantize(model, group_size=32, bits=4)
    engine = Engine(model, num_blocks=40, tensor_parallel=group)
    prompts, _ = requests()
    outputs = engine.generate(prompts[:3], SamplingParams(max_tokens=MAX_TOKENS))
    sharded = {type(m).__name__ for _, m in model.named_modules() if "Sharded" in type(m).__name__}
    return {"tokens": [o.token_ids for o in outputs], "sharded_layers": sorted(sharded)}


def refused(group, arch: str) -> dict:
    """The errors of engines that cannot be tensor-parallel."""
    sharded = tiny_model(arch)
    sharded.shard(group)
    errors = []
    for model, options in [
        (tiny_model(arch, num_attention_heads=6, num_key_value_heads=3), {}),
        (tiny_model(arch), {"scheduler": "priority"}),
        (tiny_model(arch), {"swap_policy": "disk"}),
        (tiny_model(arch), {"num_blocks": 40 + group.rank()}),
        (sharded, {}),
        (sharded, {"tensor_parallel": None}),
    ]:
        try:
            Engine(model, **{"num_blocks": 40, "tensor_parallel": group, **options})
        except ValueError as e:
            errors.append(str(e))
    return {"errors": errors}


def dies(group, arch: str) -> dict:
    """The last rank dies after a few steps; the others' error."""
    engine = Engine(tiny_model(arch), num_blocks=40, tensor_parallel=group)
    prompts, params = requests()
    for prompt, p in zip(prompts, params):
        engine.add_request(prompt, p)
    try:
        for step in range(1000):
            if step == 5 and group.rank() == group.size() - 1:
                os._exit(3)
            engine.step()
    except RuntimeError as e:
        try:  # and so do the steps after
            engine.step()
        except RuntimeError as again:
            return {"error": str(e), "again": str(again)}
    return {"error": None}


def main(case: str, arch: str, out: str):
    group = mx.distributed.init(strict=True, backend="ring")
    cases = {"smollm2": smollm2, "tiny": tiny, "speculative": speculative, "quantized": quantized, "refused": refused,
             "dies": dies}  # fmt: skip
    result = cases[case](group, arch)
    with open(out, "w") as f:
        json.dump({"rank": group.rank(), **result}, f)


if __name__ == "__main__":
    main(*sys.argv[1:])
