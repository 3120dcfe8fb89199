"""Time to the first token of one long prompt: the engine against mlx-lm's generate_step, in one process.

    PYTHONPATH=. python3 benchmarks/prefill_time.py --model deepseek-v2-lite --small --tokens 512 2048

Models as in ``engine_throughput.py`` (random weights), or with ``--smollm2`` the real SmolLM2-135M in float32
(the CPU's case). Each prompt runs once on each system to compile and warm up, then ``--rounds`` times on each in
turn; the median is reported. The engine's prefix cache is off, so both compute the whole prompt.
"""

import argparse
import statistics
import time

import mlx.core as mx
from engine_throughput import MODELS, build_model, prompts_for  # this folder
from mlx_lm.generate import generate_step
from one_stream import load

from llm_paged_mlx import Engine, SamplingParams


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", choices=MODELS, default="qwen3-0.6b")
    parser.add_argument("--small", action="store_true")
    parser.add_argument("--smollm2", action="store_true", help="the real SmolLM2-135M, float32, instead")
    parser.add_argument("--tokens", type=int, nargs="+", default=[512, 2048])
    parser.add_argument("--rounds", type=int, default=1, help="timed runs of each prompt on each system")
    parser.add_argument("--bits", type=int, choices=[4], default=None, help="quantize the weights (group 64)")
    parser.add_argument("--no-verify", action="store_true",
                        help="skip the model check (a random MoE model's expert choices can flip on rounding alone)")
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    dtype = mx.float32 if args.small else mx.bfloat16
    if args.smollm2:
        (model, _), (baseline, _) = load("smollm2", "none"), load("smollm2", "none")
        name = "SmolLM2-135M float32"
    else:
        module, config, small = MODELS[args.model]
        model = build_model(module, small if args.small else config, dtype, args.bits)
        baseline = build_model(module, small if args.small else config, dtype, args.bits)  # a GPU engine merges
        name = f"{'small ' if args.small else ''}{args.model}-shaped {dtype}"
        name += f", {args.bits}-bit weights" if args.bits else ""
    engine = Engine(model, kv_budget_bytes=1 << 30, enable_prefix_caching=False, verify_model=not args.no_verify)
    print(f"# mlx {mx.__version__} on {mx.default_device()}, {time.strftime('%Y-%m-%d')}, {name}")
    print("| prompt tokens | engine s | mlx-lm s | engine / mlx-lm |")
    print("|---:|---:|---:|---:|")
    for tokens in args.tokens:
        prompt = prompts_for(1, model.args.vocab_size, seed=tokens, low=tokens, high=tokens)[0]
        times = []
        for _ in range(1 + args.rounds):
            start = time.perf_counter()
            engine.generate([prompt], SamplingParams(max_tokens=1))
            middle = time.perf_counter()
            next(generate_step(mx.array(prompt), baseline, max_tokens=1))
            times.append((middle - start, time.perf_counter() - middle))
        ours, theirs = (statistics.median(run[i] for run in times[1:]) for i in (0, 1))
        print(f"| {tokens} | {ours:.3f} | {theirs:.3f} | {ours / theirs:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
