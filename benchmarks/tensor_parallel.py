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
their ratio, how many answers have the group's greedy tokens, and where the others first differ. With ``--kill-after S`` the launcher kills
the last rank S seconds into one more workload, and rank 0 reports how long its engine took to fail, and why
(a hang, if it has not in a minute). The launcher prints a rank's output when it fails, and ends every rank
when one fails, at ``--deadline`` and when it is itself ended.
"""

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
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
KILL_WAIT_S = 60  # how long rank 0 may take to fail after a kill, before the launcher calls it a hang
END_WAIT_S = 30  # how long the other ranks may take to end after one ended, before the launcher ends them
MODULE = MODELS["llama-8b"][0]


def parse(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--backend", choices=["nccl", "ring"], help="nccl with CUDA, else ring")
    parser.add_argument("--model", choices=SHAPES, default="llama-8b")
    parser.add_argument("--small", action="store_true", help="a 4-layer Llama shape in float32 (the CPU)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--kv-gib", type=float, default=16, help="each engine's K/V pool, GiB")
    parser.add_argument("--against-one", action="store_true", help="then the model whole on rank 0's device")
    parser.add_argument("--kill-after", type=float, metavar="S", help="then kill the last rank S s into a workload")
    parser.add_argument("--deadline", type=float, default=540, metavar="S", help="end every rank after S s")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error("--rounds: at least 1")
    if args.against_one and args.model == "llama-70b" and not args.small:
        parser.error("--against-one: a llama-70b shape (140 GB) does not fit one GPU")
    return args


def launch(args, argv) -> int:
    """Start the ranks and watch them to their end (a rank that fails early, ``--kill-after``, the
    deadline); no rank outlives the launcher."""
    backend = args.backend or default_backend()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))  # and so to the kill below
    with tempfile.TemporaryDirectory() as folder:
        logs = [Path(folder) / f"rank{r}.log" for r in range(args.ranks)]
        ranks = []
        try:
            for r, (env, log) in enumerate(zip(local_env(args.ranks, backend, folder), logs)):
                with log.open("w") as out:
                    ranks.append(subprocess.Popen([sys.executable, __file__, *argv, "--backend", backend],
                                                  env={**os.environ, **env, FOLDER: folder},
                                                  stdout=None if r == 0 else out, stderr=subprocess.STDOUT))
            return watch(ranks, logs, Path(folder), args)
        finally:
            for rank in ranks:
                rank.kill()
                rank.wait()


def watch(ranks, logs, folder: Path, args) -> int:
    """Rank 0's status once every rank has ended (or a failure's, once the launcher ended them)."""
    deadline, killed, ended, failed = time.monotonic() + args.deadline, None, None, set()
    while True:
        now = time.monotonic()
        done = [rank.poll() for rank in ranks]
        for r, status in enumerate(done[1:], 1):
            if status not in (None, 0) and not (killed and r == len(ranks) - 1) and r not in failed:
                print(f"rank {r} ended with status {status}:\n{logs[r].read_text()}", flush=True)
                failed.add(r)
                ended = ended or now
        if all(status is not None for status in done):
            return done[0]
        ended = ended or (now if done[0] is not None else None)
        if ended and now > ended + END_WAIT_S:
            print(f"ranks still running {END_WAIT_S} s after one ended: ending them", flush=True)
            return done[0] or 1
        if now > deadline:
            print(f"ranks still running after {args.deadline:g} s (--deadline): ending them", flush=True)
            return 124
        if args.kill_after is not None and not killed and (folder / "started").exists():
            killed = killed_at(folder / "started", args.kill_after, ranks[-1], folder / "killed")
        if killed and done[0] is None and now > killed + KILL_WAIT_S:
            print(f"rank 0 had not ended {KILL_WAIT_S} s after rank {len(ranks) - 1} was killed: a hang", flush=True)
            return 1
        time.sleep(0.1)


def killed_at(started: Path, after: float, rank, note: Path):
    """Kill ``rank`` once ``after`` seconds have passed since ``started`` was written, and note when in ``note``
    first (rank 0 reads it); the monotonic time of the kill, or None before."""
    if time.time() < started.stat().st_mtime + after:
        return None
    note.write_text(json.dumps(time.time()))
    rank.kill()
    return time.monotonic()


def end_with_parent(parent: int) -> None:
    """End this rank once its launcher has ended (a collective's wait does not notice)."""
    while os.getppid() == parent:
        time.sleep(1)
    os._exit(1)


class Workloads:
    """The greedy workloads, run on one engine after another: tokens/s and each answer's tokens."""

    def __init__(self, args, vocab: int, lead: bool):
        self.args, self.vocab, self.lead = args, vocab, lead
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
            progress(self.lead, f"{n} requests: {results[n][0]:.1f} tok/s")
        return results


def rank_main(args) -> None:
    threading.Thread(target=end_with_parent, args=(os.getppid(),), daemon=True).start()
    group = join(args.ranks, args.backend)
    lead = group.rank() == 0
    config, dtype = (SMALL, mx.float32) if args.small else (SHAPES[args.model], mx.bfloat16)
    kv_bytes = int(args.kv_gib * 2**30)
    start, model = time.perf_counter(), build_model(MODULE, config, dtype, evaluate=False)
    whole = sum(p.nbytes for _, p in tree_flatten(model.parameters())) / 2**30
    mx.reset_peak_memory()
    engine = Engine(model, kv_budget_bytes=kv_bytes, enable_prefix_caching=False, tensor_parallel=group)
    built, peak = time.perf_counter() - start, mx.get_peak_memory() / 2**30
    held = sum(p.nbytes for _, p in tree_flatten(model.parameters())) / 2**30
    progress(lead, f"engine built in {built:.1f} s")
    workloads = Workloads(args, config["vocab_size"], lead)
    ours = workloads.run(engine)
    if lead:
        shape = f"{'small ' if args.small else ''}{args.model} shape, {'float32' if args.small else 'bf16'}"
        print(f"# {time.strftime('%Y-%m-%d')}, mlx {mx.__version__} on {mx.default_device()}, {shape}, "
              f"{args.ranks} ranks over {args.backend}; the engine built in {built:.1f} s; rank 0 holds {held:.2f} "
              f"of the model's {whole:.2f} GiB of weights, its peak while building {peak:.2f} GiB (a {args.kv_gib:g} "
              f"GiB K/V pool); prompts of 32-160 tokens, {args.new_tokens} new tokens each, tok/s medians of "
              f"{args.rounds}", flush=True)
        if args.against_one:  # the other ranks end, or wait for the last workload (kill_workload)
            one = workloads.run(Engine(build_model(MODULE, config, dtype), kv_budget_bytes=kv_bytes,
                                       enable_prefix_caching=False))  # fmt: skip
            print(f"| requests | {args.ranks} ranks | one device | ratio | answers equal | first differing token "
                  "(least, median) |\n|---:|---:|---:|---:|---:|---:|")
            for n, (rate, tokens) in ours.items():
                firsts = [first_difference(a, b) for a, b in zip(tokens, one[n][1])]
                same = sum(f == len(a) for f, a in zip(firsts, tokens))
                print(f"| {n} | {rate:.1f} | {one[n][0]:.1f} | {rate / one[n][0]:.2f}x | {same} of {n} | "
                      f"{min(firsts)}, {statistics.median(firsts):g} |", flush=True)
        else:
            print(f"| requests | {args.ranks} ranks |\n|---:|---:|")
            print("\n".join(f"| {n} | {rate:.1f} |" for n, (rate, _) in ours.items()), flush=True)
    if args.kill_after is not None:
        kill_workload(engine, workloads, group, Path(os.environ[FOLDER]))
    os._exit(0)  # the group's communicators are never closed: a backend's teardown may wait for peers


def first_difference(a: list[int], b: list[int]) -> int:
    """The index of the first token where two answers differ (their length if they do not)."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def progress(lead: bool, what: str) -> None:
    if lead:
        print(f"[{time.strftime('%H:%M:%S')}] {what}", file=sys.stderr, flush=True)


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
        return
    if group.rank() == 0:
        print("the workload ended before the kill: give a shorter --kill-after", flush=True)


if __name__ == "__main__":
    if LAUNCHED_RANK in os.environ:
        rank_main(parse())
    else:
        sys.exit(launch(parse(), sys.argv[1:]))
