"""What "nothing wrong, nothing lost" costs (issue J), each as a ratio within one process.

1. Transactional steps: the same engine decoding the same workload with its steps journaled
   (the default) and with the journal turned off (``begin``/``commit`` made no-ops, as the
   engine ran before), in alternation; medians of ``--rounds`` runs, tokens/s.
2. The model self-check at load: its time against the time to build the rest of the engine
   (``verify_model=False``), for a new fingerprint and for a known one.
3. Model identity from content: hashing the weight files the first time, against reading the
   kept digests later (``--model`` folders only).

    python benchmarks/safety_costs.py [--small] [--concurrency 1 16 64] [--model FOLDER]

Without ``--model`` the model is random-weight Qwen3-0.6B-shaped bf16 (``--small``: a
4-layer fp32 one, for the CPU).
"""

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import mlx.core as mx
from mlx_lm.models import qwen3

sys.path.insert(0, str(Path(__file__).resolve().parent))

from engine_throughput import QWEN3_0_6B, SMALL, build_model, prompts_for  # noqa: E402

from llm_paged_mlx import Engine, SamplingParams  # noqa: E402
from llm_paged_mlx.engine import model_check  # noqa: E402
from llm_paged_mlx.engine.kv_coordinator import KVCoordinator  # noqa: E402
from llm_paged_mlx.engine.kv_pools import KVPools  # noqa: E402
from llm_paged_mlx.engine.scheduler import Scheduler  # noqa: E402


def no_journal():
    """Make the engine's transactions no-ops (what the journal costs is then missing); returns an undo."""
    saved = [(cls, name, getattr(cls, name)) for cls in (Scheduler, KVPools) for name in ("begin", "commit")]
    for cls, name, _ in saved:
        setattr(cls, name, lambda self: None)
    saved.append((KVCoordinator, "held_before", KVCoordinator.held_before))
    KVCoordinator.held_before = lambda self, blocks: ([], [])  # with no journal no block changed hands

    def undo():
        for cls, name, method in saved:
            setattr(cls, name, method)

    return undo


def journal_ratio(model, concurrency, new_tokens, rounds, kv_bytes):
    vocab = model.args.vocab_size
    print(f"{'requests':>8} {'journaled':>10} {'no journal':>11} {'ratio':>6}")
    for n in concurrency:
        prompts = prompts_for(n, vocab, seed=n)
        engine = Engine(model, kv_budget_bytes=kv_bytes, max_num_seqs=max(64, n), enable_prefix_caching=False)
        params = SamplingParams(max_tokens=new_tokens, ignore_eos=True)

        def run(journaled: bool) -> float:
            undo = None if journaled else no_journal()
            try:
                start = time.perf_counter()
                outs = engine.generate(prompts, params)
                return sum(len(o.token_ids) for o in outs) / (time.perf_counter() - start)
            finally:
                if undo:
                    undo()

        run(True)
        run(False)
        tps = {True: [], False: []}
        for _ in range(rounds):
            for journaled in (True, False):
                tps[journaled].append(run(journaled))
        on, off = statistics.median(tps[True]), statistics.median(tps[False])
        print(f"{n:>8} {on:>10.1f} {off:>11.1f} {on / off:>5.3f}x", flush=True)


def self_check_cost(model):
    def build(**options):
        start = time.perf_counter()
        Engine(model, num_blocks=64, **options)  # a small pool: its allocation is not what is timed
        return time.perf_counter() - start

    build(verify_model=False)  # warm: kernels, allocator
    model_check._verdicts.clear()
    with tempfile.TemporaryDirectory() as folder:
        verdicts = Path(folder) / "verdicts.json"
        first = build(verdict_file=verdicts)
        model_check._verdicts.clear()  # a new process: the verdict comes from the file
        known = build(verdict_file=verdicts)
    plain = statistics.median(build(verify_model=False) for _ in range(3))
    print(f"engine built without the check: {plain:.3f} s; with it, new fingerprint: {first:.3f} s "
          f"(+{first - plain:.3f} s, {first / plain:.2f}x); known fingerprint: {known:.3f} s ({known / plain:.2f}x)")


def identity_cost(folder):
    from llm_paged_mlx.models.identity import model_identity

    with tempfile.TemporaryDirectory() as scratch:
        digests = Path(scratch) / "digests.json"
        start = time.perf_counter()
        model_identity(folder, digests)
        first = time.perf_counter() - start
        start = time.perf_counter()
        model_identity(folder, digests)
        later = time.perf_counter() - start
    size = sum(p.stat().st_size for p in Path(folder).glob("*.safetensors"))
    print(f"model identity of {size / 1e6:.0f} MB of weights: first {first:.3f} s "
          f"({size / first / 1e9:.2f} GB/s), later {later * 1e3:.2f} ms ({first / later:.0f}x less)")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--small", action="store_true", help="a 4-layer fp32 model, for the CPU")
    parser.add_argument("--model", help="an mlx-lm folder instead of a random model")
    parser.add_argument("--kv-gib", type=float, default=4)
    args = parser.parse_args(argv)
    kv_bytes = int(args.kv_gib * 2**30)
    if args.model:
        from llm_paged_mlx.models.loading import load_model

        model, _ = load_model(args.model)
        name = Path(args.model).name
    else:
        dtype = mx.float32 if args.small else mx.bfloat16
        model = build_model(qwen3, SMALL if args.small else QWEN3_0_6B, dtype)
        name = f"{'small' if args.small else 'Qwen3-0.6B-shaped'} {dtype}"
    print(f"# mlx {mx.__version__} on {mx.default_device()}, {time.strftime('%Y-%m-%d')}, {name}, "
          f"{args.new_tokens} new tokens per request")
    journal_ratio(model, args.concurrency, args.new_tokens, args.rounds, kv_bytes)
    self_check_cost(model)
    if args.model:
        identity_cost(args.model)


if __name__ == "__main__":
    main()
