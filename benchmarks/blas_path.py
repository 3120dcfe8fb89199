"""Does a plain `llm` get OpenBLAS? `llm -m paged-smollm2` as a user runs it, against OpenBLAS preloaded.

    .venv/bin/python benchmarks/blas_path.py [--llm .venv/bin/llm] [--runs 5] [--sentences 36] [--bundled]

The same command runs in each of these ways, each with an LLM_USER_PATH of its own (so that each meets
the model check once, in its first run, and no way reads another's disk tier):

  plain      `llm ...` in an environment without LD_PRELOAD, as after `make demo`
  preloaded  LD_PRELOAD=OpenBLAS, as the Makefile used to run it
  bundled    (with --bundled) LLM_PAGED_MLX_OPENBLAS=0: MLX's bundled reference BLAS, for scale

Runs alternate between the ways (run i of every way, then run i + 1, each run starting with the
next way), so that the machine's load falls on all of them alike. Run i has a prompt of its own (its
number comes first), the same in every way: no run hits another's prefix cache, and greedy decoding
must give every way the same text. Printed: the first run's wall time (it includes the model
check), the median time to first token (`ttft_s` in `llm logs`: in a new process, loading the
model is part of it) and decode rate of the later runs, each way's ratio to preloaded, and the
median over those runs of plain's time to first token over preloaded's in the same run.
Acceptance: plain within 1.2x of preloaded.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from llm_paged_mlx.catalog import CACHE_ENV, default_model_cache
from llm_paged_mlx_openblas import ENV, OPENBLAS

SENTENCE = "Block {} of the pool holds sixteen tokens of keys and values for one request."


def prompt(run: int, sentences: int) -> str:
    text = " ".join(SENTENCE.format(k) for k in range(sentences))
    return f"Request {run}. Say in one sentence what this text is about.\n\n{text}"


def run_once(llm: str, env: dict, text: str, max_tokens: int) -> dict:
    start = time.perf_counter()
    answer = subprocess.run([llm, "-m", "paged-smollm2", "-o", "max_tokens", str(max_tokens), text],
                            env=env, capture_output=True, text=True, check=True).stdout
    wall = time.perf_counter() - start
    logs = subprocess.run([llm, "logs", "--json", "-n", "1"], env=env, capture_output=True, text=True, check=True)
    numbers = json.loads(logs.stdout)[0]["response_json"]
    return {"wall_s": wall, "answer": answer, **numbers}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--llm", default=str(Path(sys.executable).parent / "llm"))
    parser.add_argument("--runs", type=int, default=5, help="runs per way (the first includes the model check)")
    parser.add_argument("--sentences", type=int, default=36, help="the prompt's length (36: 688 tokens)")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--bundled", action="store_true", help="also run on MLX's bundled BLAS (slow)")
    args = parser.parse_args()
    if args.runs < 2:
        parser.error("--runs must be at least 2: the first run of each way has the model check")
    if not os.path.isfile(OPENBLAS):
        sys.exit(f"OpenBLAS is not installed ({OPENBLAS}): nothing to compare")

    base = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", ENV)}
    base[CACHE_ENV] = str(default_model_cache())  # every way loads the model already fetched
    ways = {"plain": {}, "preloaded": {"LD_PRELOAD": OPENBLAS}}
    if args.bundled:
        ways["bundled"] = {ENV: "0"}
    results = {way: [] for way in ways}
    with tempfile.TemporaryDirectory() as tmp:
        envs = {way: {**base, **extra, "LLM_USER_PATH": str(Path(tmp) / way)} for way, extra in ways.items()}
        for run in range(args.runs):
            order = list(ways)[run % len(ways):] + list(ways)[:run % len(ways)]
            for way in order:
                result = run_once(args.llm, envs[way], prompt(run, args.sentences), args.max_tokens)
                results[way].append(result)
                print(f"run {run} {way:>9}: wall {result['wall_s']:6.2f} s, ttft {result['ttft_s']:6.2f} s, "
                      f"{result['tokens_per_s']:5.1f} tok/s, {result['prompt_tokens']} prompt tokens", flush=True)

    for run in range(args.runs):
        answers = {way: results[way][run]["answer"] for way in ways}
        if len(set(answers.values())) != 1:
            sys.exit(f"run {run}: the ways answered differently: {answers}")
    print(f"\nSame text in every way, every run. Medians over runs 1-{args.runs - 1} (run 0 has the model check):")
    summary = {}
    for way in ways:
        later = results[way][1:]
        summary[way] = {"first_wall_s": results[way][0]["wall_s"],
                        "ttft_s": statistics.median(r["ttft_s"] for r in later),
                        "tokens_per_s": statistics.median(r["tokens_per_s"] for r in later)}
    ref = summary["preloaded"]
    for way, s in summary.items():
        print(f"{way:>9}: first run {s['first_wall_s']:6.2f} s ({s['first_wall_s'] / ref['first_wall_s']:.2f}x), "
              f"ttft {s['ttft_s']:6.2f} s ({s['ttft_s'] / ref['ttft_s']:.2f}x), "
              f"decode {s['tokens_per_s']:5.1f} tok/s ({ref['tokens_per_s'] / s['tokens_per_s']:.2f}x the time)")
    ratio = statistics.median(p["ttft_s"] / r["ttft_s"] for p, r in zip(results["plain"][1:], results["preloaded"][1:]))
    verdict = "within" if ratio <= 1.2 else "NOT within"
    print(f"\nplain / preloaded time to first token, median of the runs' ratios: {ratio:.2f}x ({verdict} 1.2x)")


if __name__ == "__main__":
    main()
