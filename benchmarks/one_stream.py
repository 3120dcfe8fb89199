"""One stream, the engine against mlx-lm's ``generate_step``, in one process: the number a user compares first.

    PYTHONPATH=. python3 benchmarks/one_stream.py [--models qwen3-0.6b llama-8b] [--bits none 4] [--smollm2]

For each random-weight model (bf16, or with ``--bits 4`` 4-bit weights, group 64), or with ``--smollm2``
the real SmolLM2-135M (float32, and ``--bits 4``: its 4-bit GGUF weights; the CPU's case), one prompt of 64-128 tokens and ``--new-tokens`` new tokens (EOS ignored): tokens
per second of the whole answer (its prefill included), mlx-lm's greedy ``generate_step`` and the engine
(one request on one ``Engine``, as ``llm -m`` runs it) in alternation, one warm-up each, medians of
``--rounds``.
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx
from engine_throughput import QWEN3_0_6B, SMALL, build_model, prompts_for  # this folder
from long_context import LLAMA_8B
from mlx_lm.generate import generate_step
from mlx_lm.models import llama, qwen3

from llm_paged_mlx import Engine, SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # smollm2.py: where the model is kept

MODELS = {"qwen3-0.6b": (qwen3, QWEN3_0_6B), "llama-8b": (llama, LLAMA_8B)}


def load(name: str, bits: str):
    """The model and its vocabulary size."""
    if name == "smollm2":
        from smollm2 import smollm2_dir

        from llm_paged_mlx.models.loading import load_model

        model, _ = load_model(str(smollm2_dir()), dequantize=bits == "none", dtype="float32")
        return model, model.args.vocab_size
    module, config = MODELS[name]
    model = build_model(module, config, mx.bfloat16, None if bits == "none" else int(bits))
    return model, config["vocab_size"]


def mlx_lm_tps(model, prompt, new_tokens: int) -> float:
    start = time.perf_counter()
    count = sum(1 for _ in generate_step(mx.array(prompt), model, max_tokens=new_tokens, sampler=lambda x: mx.argmax(x, -1)))
    return count / (time.perf_counter() - start)


def engine_tps(engine, prompt, new_tokens: int) -> float:
    start = time.perf_counter()
    (out,) = engine.generate([prompt], SamplingParams(max_tokens=new_tokens, ignore_eos=True))
    return len(out.token_ids) / (time.perf_counter() - start)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    parser.add_argument("--bits", nargs="+", choices=["none", "4"], default=["none", "4"])
    parser.add_argument("--smollm2", action="store_true", help="the real SmolLM2-135M instead (the CPU)")
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    print(f"# {time.strftime('%Y-%m-%d')}, mlx {mx.__version__} on {mx.default_device()}, one prompt of 64-128 "
          f"tokens, {args.new_tokens} new tokens, tok/s medians of {args.rounds}")
    print("| model | weights | mlx-lm generate_step | engine | engine / mlx-lm |")
    print("|---|---|---:|---:|---:|")
    for name in ["smollm2"] if args.smollm2 else args.models:
        for bits in args.bits:
            model, vocab = load(name, bits)
            baseline, _ = load(name, bits)  # mlx-lm's own: an engine on a GPU merges its model's projections
            prompt = prompts_for(1, vocab, 1, 64, 128)[0]
            engine = Engine(model, kv_budget_bytes=4 * 2**30)
            theirs, ours = [], []
            for round in range(args.rounds + 1):  # the first is a warm-up
                theirs.append(mlx_lm_tps(baseline, prompt, args.new_tokens))
                ours.append(engine_tps(engine, prompt, args.new_tokens))
            theirs, ours = statistics.median(theirs[1:]), statistics.median(ours[1:])
            weights = f"{bits}-bit" if bits != "none" else ("float32" if args.smollm2 else "bf16")
            print(f"| {name} | {weights} | {theirs:.1f} | {ours:.1f} | {ours / theirs:.2f}x |", flush=True)
            del model, baseline, engine


if __name__ == "__main__":
    main()
