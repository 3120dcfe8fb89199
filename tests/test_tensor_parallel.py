"""Tensor parallelism: two ranks over MLX's ring backend on this machine, each holding half of a model's heads.

Each rank is a process of its own running tests/tensor_parallel_rank.py, as ``mlx.launch`` would start it.
"""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from models import tiny_model
from smollm2 import smollm2_dir
from tensor_parallel_rank import MAX_TOKENS, QUESTIONS, SMOLLM2_TOKENS, requests
from test_engine import reference
from test_engine_smollm2 import chat

from llm_paged_mlx import Engine, SamplingParams

RANKS = 2
HERE = Path(__file__).parent


def free_ports(n: int) -> list[int]:
    sockets = [socket.socket() for _ in range(n)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


def run_ranks(tmp_path, case: str, arch: str, size: int = RANKS) -> list[dict]:
    """Run the case on ``size`` ranks; what each wrote."""
    hosts = tmp_path / "hosts.json"
    hosts.write_text(json.dumps([[f"127.0.0.1:{port}"] for port in free_ports(size)]))
    outs = [tmp_path / f"rank{rank}.json" for rank in range(size)]
    env = {**os.environ, "MLX_HOSTFILE": str(hosts), "PYTHONPATH": f"{HERE}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    ranks = [
        subprocess.Popen(
            [sys.executable, str(HERE / "tensor_parallel_rank.py"), case, arch, str(out)],
            env={**env, "MLX_RANK": str(rank)}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        for rank, out in enumerate(outs)
    ]  # fmt: skip
    try:
        logs = [rank.communicate(timeout=300)[0] for rank in ranks]
    finally:
        for rank in ranks:
            rank.kill()
    for rank, log in zip(ranks, logs):
        assert rank.returncode == 0 or (case == "dies" and rank is ranks[-1]), log
    return [json.loads(out.read_text()) for out in outs if out.exists()]


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_two_ranks_give_mlx_lm_tokens_and_the_same_samples(tmp_path, arch):
    """Greedy requests get mlx-lm's tokens from the unsharded model; sampled ones without a seed, rank 0's
    draws on both ranks; under preemption, with the prefix cache, and every block back."""
    ranks = run_ranks(tmp_path, "tiny", arch)
    assert ranks[0]["tokens"] == ranks[1]["tokens"]
    model = tiny_model(arch)
    prompts, params = requests()
    for prompt, p, tokens in zip(prompts, params, ranks[0]["tokens"]):
        if p.temperature == 0:
            assert tokens == reference(model, prompt, MAX_TOKENS)
        else:
            assert len(tokens) == MAX_TOKENS
    for rank in ranks:
        assert rank["kv_heads"] == model.layers[0].self_attn.n_kv_heads // RANKS
        assert rank["preemptions"] > 0 and rank["prefix_cache_hit_tokens"] > 0
        assert rank["free_blocks"] == rank["num_blocks"]


def test_what_cannot_be_split_or_would_decide_differently_on_each_rank_is_refused(tmp_path):
    for rank in run_ranks(tmp_path, "refused", "llama"):
        assert rank["errors"] == [
            "llama: its 3 key value heads do not divide over 2 devices",
            "scheduler 'priority' ages requests by each rank's own clock: use 'fcfs' with tensor_parallel",
            "swap_policy 'disk' may decide differently on each rank: use 'recompute' or 'cpu' with tensor_parallel",
            "the ranks of a tensor-parallel engine were given different options: every rank must build the same engine",
        ] + ["the model is already sharded over devices: give the unsharded model with tensor_parallel=group, which "
             "shards it"] * 2  # fmt: skip


def test_a_rank_that_dies_ends_the_others_steps_with_an_error_not_a_hang(tmp_path):
    (survivor,) = run_ranks(tmp_path, "dies", "llama")
    assert "connection to a peer was lost" in survivor["error"] and "out of step" in survivor["error"]
    assert survivor["again"] == survivor["error"]


def test_smollm2_over_three_ranks_answers_as_one_process(tmp_path):
    """SmolLM2's 9 query and 3 KV heads over 3 ranks, loaded lazily (each rank holds its shard): the greedy
    answers of the single-process engine."""
    ranks = run_ranks(tmp_path, "smollm2", "llama", size=3)
    engine = Engine.from_pretrained(str(smollm2_dir()), kv_budget_bytes=64 << 20)
    prompts = [chat(engine.tokenizer, q) for q in QUESTIONS]
    expected = [o.token_ids for o in engine.generate(prompts, SamplingParams(max_tokens=SMOLLM2_TOKENS))]
    for rank in ranks:
        assert rank["tokens"] == expected and rank["kv_heads"] == 1
