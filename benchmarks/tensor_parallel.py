"""Tensor parallelism (issue P): one engine over the ranks of an ``mx.distributed`` group on this machine,
and the same model on one device, in one run.

    python benchmarks/tensor_parallel.py --ranks 2 --model llama-8b --concurrency 1 16 64 --against-one
    python benchmarks/tensor_parallel.py --ranks 2 --model llama-70b --concurrency 1 16 64 --kill-after 5
    python benchmarks/tensor_parallel.py --ranks 2 --model llama-8b --small --concurrency 1 4   # the CPU (ring)

The script starts ``--ranks`` processes of itself, as ``mlx.launch -n`` would (nccl with CUDA, a GPU a rank,
else ring: ``parallel.ranks.local_env``). Each rank builds the random-weight bf16 model (float32 with
``--small``) with its weights lazy and gives it unsharded to ``Engine(model, tensor_parallel=group)``, which
shards it and evaluates the rank's share alone: a Llama-70B shape (140 GB) is never whole on one device.
Each workload, ``--concurrency`` greedy requests (prompts of 32-160 tokens, ``--new-tokens`` each, EOS
ignored), runs once to warm up and then ``--rounds`` times; rank 0 prints tokens/s, medians. With
``--against-one``, rank 0 then builds the same model whole on its own device and runs the same workloads:
their ratio, and how many answers have the group's greedy tokens. With ``--kill-after S`` the launcher kills
the last rank S seconds into one more workload, and rank 0 reports how long its engine took to fail, and why.
"""

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten
from engine_throughput import MODELS, build_model, prompts_for  # this folder

from llm_paged_mlx import Engine, SamplingParams
from llm_paged_mlx.parallel.ranks import LAUNCHED_RANK, default_backend, join, local_env

LLAMA_70B = dict(MODELS["llama-8b"][1], hidden_size=8192, num_hidden_layers=80, intermediate_size=28672,
                 num_attention_heads=64, num_key_value_heads=8)  # fmt: skip
SHAPES = {"llama-8b": MODELS["llama-8b"][1], "llama-70b": LLAMA_70B}
SMALL = MODELS["llama-8b"][2]
FOLDER = "TENSOR_PARALLEL_BENCH_FOLDER"  # where the launcher and rank 0 leave each other word of a kill
KILL_WAIT_S = 60  # how long the launcher waits for rank 0 after a kill (then: a hang, and it kills rank 0)
MODULE = MODELS["llama-8b"][0]


def parse(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--backend", choices=["nccl", "ring"], help="nccl with CUDA, else ring")
    parser.add_argument("--model", choices=SHAPES, default="llama-8b")
    parser.add_argument("--small", action="store_true", help="a 4-layer Llama shape in float32 (the CPU)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--kv-gib", type=float, default=16, help="each engine's K/V pool, GiB")
    parser.add_argument("--against-one", action="store_true", help="then the model whole on rank 0's device")
    parser.add_argument("--kill-after", type=float, metavar="S", help="then kill the last rank S s into a workload")
    return parser.parse_args(argv)


def launch(args, argv) -> int:
    """Start the ranks and wait for them; with ``--kill-after``, kill the last one once rank 0 says so."""
    backend = args.backend or default_backend()
    with tempfile.TemporaryDirectory() as folder:
        logs = [Path(folder) / f"rank{r}.log" for r in range(args.ranks)]
        ranks = [
            subprocess.Popen([sys.executable, __file__, *argv, "--backend", backend],
                             env={**os.environ, **env, FOLDER: folder},
                             stdout=None if r == 0 else log.open("w"), stderr=subprocess.STDOUT)
            for r, (env, log) in enumerate(zip(local_env(args.ranks, backend, folder), logs))
        ]  # fmt: skip
        try:
            if args.kill_after is not None:
                kill_when_told(ranks, Path(folder), args.kill_after)
            status = ranks[0].wait()
            deadline = time.monotonic() + KILL_WAIT_S
            while any(rank.poll() is None for rank in ranks) and time.monotonic() < deadline:
                time.sleep(0.1)
        finally:
            for rank in ranks:
                rank.kill()
        for r, (rank, log) in enumerate(zip(ranks[1:], logs[1:]), 1):
            if rank.wait() not in (0, -signal.SIGKILL):
                print(f"rank {r} ended with status {rank.returncode}:\n{log.read_text()}")
    return status


def kill_when_told(ranks, folder: Path, after: float) -> None:
    """Kill the last rank ``after`` seconds once rank 0 starts its last workload, and note when."""
    while not (folder / "started").exists():
        if ranks[0].poll() is not None:
            return
        time.sleep(0.1)
    time.sleep(after)
    ranks[-1].kill()
    (folder / "killed").write_text(json.dumps(time.time()))
    try:
        ranks[0].wait(timeout=KILL_WAIT_S)
    except subprocess.TimeoutExpired:
        print(f"rank 0 had not ended {KILL_WAIT_S} s after rank {len(ranks) - 1} was killed: a hang", flush=True)
        ranks[0].kill()


class Workloads:
    """The greedy workloads, run on one engine after another: tokens/s and each answer's tokens."""

    def __init__(self, args, vocab: int):
        self.args, self.vocab = args, vocab
        self.params = SamplingParams(max_tokens=args.new_tokens, ignore_eos=True)

    def prompts(self, n: int) -> list[list[int]]:
        return prompts_for(n, self.vocab, n)

    def run(self, engine) -> dict[int, tuple[float, list[list[int]]]]:
        results = {}
        for n in self.args.concurrency:
            prompts, rates = self.prompts(n), []
            for _ in range(self.args.rounds + 1):  # the first warms up
                start = time.perf_counter()
                outputs = engine.generate(prompts, self.params)
                rates.append(sum(len(o.token_ids) for o in outputs) / (time.perf_counter() - start))
            results[n] = statistics.median(rates[1:]), [o.token_ids for o in outputs]
        return results


def rank_main(args) -> None:
    group = join(args.ranks, args.backend)
    lead = group.rank() == 0
    config, dtype = (SMALL, mx.float32) if args.small else (SHAPES[args.model], mx.bfloat16)
    kv_bytes = int(args.kv_gib * 2**30)
    start, model = time.perf_counter(), build_model(MODULE, config, dtype, evaluate=False)
    engine = Engine(model, kv_budget_bytes=kv_bytes, enable_prefix_caching=False, tensor_parallel=group)
    built = time.perf_counter() - start
    held = sum(p.nbytes for _, p in tree_flatten(model.parameters())) / 2**30
    workloads = Workloads(args, config["vocab_size"])
    ours = workloads.run(engine)
    if lead:
        shape = f"{'small ' if args.small else ''}{args.model} shape, {'float32' if args.small else 'bf16'}"
        print(f"# {time.strftime('%Y-%m-%d')}, mlx {mx.__version__} on {mx.default_device()}, {shape}, "
              f"{args.ranks} ranks over {args.backend}; engine built in {built:.1f} s; rank 0 holds {held:.2f} GiB of "
              f"weights, its peak memory {mx.get_peak_memory() / 2**30:.2f} GiB with a {args.kv_gib:g} GiB K/V pool; "
              f"prompts of 32-160 tokens, {args.new_tokens} new tokens each, tok/s medians of {args.rounds}", flush=True)
        if args.against_one:  # the other ranks end, or wait for the last workload (kill_workload)
            one = workloads.run(Engine(build_model(MODULE, config, dtype), kv_budget_bytes=kv_bytes,
                                       enable_prefix_caching=False))  # fmt: skip
            print(f"| requests | {args.ranks} ranks | one device | ratio | answers with one device's greedy tokens |")
            print("|---:|---:|---:|---:|---:|")
            for n, (rate, tokens) in ours.items():
                same = sum(a == b for a, b in zip(tokens, one[n][1]))
                print(f"| {n} | {rate:.1f} | {one[n][0]:.1f} | {rate / one[n][0]:.2f}x | {same} of {n} |", flush=True)
        else:
            print(f"| requests | {args.ranks} ranks |\n|---:|---:|")
            print("\n".join(f"| {n} | {rate:.1f} |" for n, (rate, _) in ours.items()), flush=True)
    if args.kill_after is not None:
        kill_workload(engine, workloads, group, Path(os.environ[FOLDER]))


def kill_workload(engine, workloads, group, folder: Path) -> None:
    """One more workload, whose last rank the launcher kills: rank 0 says how long its engine took to fail.
    The other ranks wait for rank 0 to start it asleep (a collective's wait would keep a core busy)."""
    started = folder / "started"
    if group.rank() == 0:
        started.write_text("")
    while not started.exists():
        time.sleep(0.1)
    n = max(workloads.args.concurrency)
    params = SamplingParams(max_tokens=1 << 16, ignore_eos=True)  # until the kill (or the pool's limit)
    try:
        engine.generate(workloads.prompts(n), params)
    except Exception as e:  # what a user of the group gets
        if group.rank() == 0:
            kill = folder / "killed"
            when = f"{time.time() - json.loads(kill.read_text()):.1f} s after" if kill.exists() else "before"
            print(f"rank {group.size() - 1} killed during {n} requests: rank 0's engine failed {when} the kill, "
                  f"with {type(e).__name__}: {e}", flush=True)
        os._exit(0)  # the group is gone: nothing of it can be closed
    if group.rank() == 0:
        print("the workload ended before the kill: give a shorter --kill-after", flush=True)


if __name__ == "__main__":
    if LAUNCHED_RANK in os.environ:
        rank_main(parse())
    else:
        sys.exit(launch(parse(), sys.argv[1:]))
