"""Start-up with a large KV budget: pools that grow as requests need them, against pools allocated whole.

On the offline SmolLM2 model, an Engine with a ``--budget-gib`` budget is built
and answers a short prompt, first with the pools starting small and growing
(the engine's way), then with ``INITIAL_POOL_BYTES`` set to the budget (the
whole pool allocated and zeroed at start), alternating ``--rounds`` times in
one process. Verdicts are cached in-process, so the model check runs once.

    python benchmarks/startup.py [--budget-gib 4] [--rounds 2]
"""

import argparse
import gc
import platform
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from llm_paged_mlx import Engine, SamplingParams  # noqa: E402
from llm_paged_mlx.engine import sizing  # noqa: E402
from llm_paged_mlx.models.loading import load_model  # noqa: E402

PROMPT = "The capital of France is"


def start_and_answer(model, tokenizer, budget, initial):
    sizing.INITIAL_POOL_BYTES = initial
    gc.collect()
    mx.clear_cache()
    start = time.perf_counter()
    engine = Engine(model, tokenizer, kv_budget_bytes=budget)
    built = time.perf_counter() - start
    engine.generate([PROMPT], SamplingParams(max_tokens=8))
    return built, time.perf_counter() - start, engine.runner.kv.nbytes


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--budget-gib", type=float, default=4.0)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args(argv)
    budget = int(args.budget_gib * 2**30)
    growing = sizing.INITIAL_POOL_BYTES
    from smollm2 import smollm2_dir  # tests/smollm2.py: the converted offline model

    model, tokenizer = load_model(str(smollm2_dir()), dequantize=True, dtype="float32")
    start_and_answer(model, tokenizer, budget, growing)  # warm-up: the model check, compiled steps
    results = {"growing": [], "whole": []}
    for _ in range(args.rounds):
        results["growing"].append(start_and_answer(model, tokenizer, budget, growing))
        results["whole"].append(start_and_answer(model, tokenizer, budget, budget))
    print(f"{platform.machine()} {platform.processor() or ''}, MLX {mx.__version__} on {mx.default_device()}")
    print(f"| pools | engine built (s) | first answer (s) | pool at the answer |")
    print("|---|---|---|---|")
    for name, runs in results.items():
        built = statistics.median(r[0] for r in runs)
        answer = statistics.median(r[1] for r in runs)
        print(f"| {name} | {built:.2f} | {answer:.2f} | {runs[-1][2] / 2**20:,.0f} MiB |")
    ratio = statistics.median(r[1] for r in results["whole"]) / statistics.median(r[1] for r in results["growing"])
    print(f"first answer, whole / growing: {ratio:.1f}x")


if __name__ == "__main__":
    main()
