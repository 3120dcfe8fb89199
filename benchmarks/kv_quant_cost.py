"""What faithful quantized K/V cost: the engine's K/V quantization against the plain one, in one process.

The engine writes quantized keys rotated (a Hadamard matrix per group, ``kernels.quantized``), and
a prompt chunk attends to its own K/V before quantization. The plain way writes ``mx.quantize``'s
rows as they are and reads every key from the pool. This times the
plain way, then each part of the engine's way added, on one model: one stream (time to first token
of a prompt, then decode tokens/s) and a batch of concurrent requests, alternating the ways after a
warm-up, medians reported.

    python benchmarks/kv_quant_cost.py                  # Llama-3.1-8B shape, bf16 (a GPU)
    python benchmarks/kv_quant_cost.py --smollm2        # SmolLM2 float32 (the CPU)

Usage: [--bits 8 4] [--prompt-tokens 2048] [--new-tokens 128] [--concurrency 16] [--rounds 2] [--ways 0 1 2]
(the first way timed is the base of the ratios)
"""

import argparse
import contextlib
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx
from mlx_lm.models import llama

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from engine_throughput import build_model, prompts_for  # noqa: E402
from long_context import LLAMA_8B  # noqa: E402

from llm_paged_mlx import Engine, SamplingParams  # noqa: E402
from llm_paged_mlx.models import paged_cache  # noqa: E402


WAYS = {  # name: (prompts attend to their own K/V before quantization, keys stored rotated)
    "mx.quantize, as written": (False, False),
    "own rows": (True, False),
    "own rows, keys rotated (the engine)": (True, True),
}


@contextlib.contextmanager
def quantization(own_rows: bool, rotated: bool):
    """Within it, new engines store quantized K/V in one of ``WAYS``: each part of the engine's way on or off."""
    cache = paged_cache.PagedLayerCache
    saved = cache.prompts_attend_unquantized, cache.rotates_quantized_rows
    cache.prompts_attend_unquantized, cache.rotates_quantized_rows = own_rows, rotated
    try:
        yield
    finally:
        cache.prompts_attend_unquantized, cache.rotates_quantized_rows = saved


def one_stream(engine, prompt, new_tokens) -> tuple[float, float]:
    """Time to first token (s) and decode tokens/s after it, for one request alone."""
    start = time.perf_counter()
    first = None
    count = 0
    for chunk in engine.stream(prompt, SamplingParams(max_tokens=new_tokens, ignore_eos=True)):
        count += len(chunk.token_ids)
        if first is None and count:
            first = time.perf_counter()
    return first - start, (count - 1) / (time.perf_counter() - first)


def batch(engine, prompts, new_tokens) -> float:
    start = time.perf_counter()
    outs = engine.generate(prompts, SamplingParams(max_tokens=new_tokens, ignore_eos=True))
    return sum(len(o.token_ids) for o in outs) / (time.perf_counter() - start)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smollm2", action="store_true", help="the real SmolLM2, float32 (else a random 8B shape)")
    parser.add_argument("--bits", type=int, nargs="+", default=[8, 4])
    parser.add_argument("--prompt-tokens", type=int, default=2048)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--kv-gib", type=float, default=8)
    parser.add_argument("--ways", type=int, nargs="+", default=list(range(len(WAYS))),
                        help="which of the ways to time (0: the plain one), by index")
    args = parser.parse_args()
    if args.smollm2:
        from smollm2 import smollm2_dir

        from llm_paged_mlx.models.loading import load_model

        model, _ = load_model(str(smollm2_dir()), dequantize=True, dtype="float32")
        name, vocab = "SmolLM2-135M float32", model.args.vocab_size
    else:
        model = build_model(llama, LLAMA_8B, mx.bfloat16)
        name, vocab = "Llama-3.1-8B-shaped bf16 (random weights)", LLAMA_8B["vocab_size"]
    print(f"# {time.strftime('%Y-%m-%d')}, mlx {mx.__version__} on {mx.default_device()}, {name}")
    prompt = prompts_for(1, vocab, 1, args.prompt_tokens, args.prompt_tokens)[0]
    prompts = prompts_for(args.concurrency, vocab, 2)
    print(f"| kv_bits | quantization | TTFT {args.prompt_tokens} tokens (s) | one stream tok/s "
          f"| {args.concurrency} requests tok/s |")
    print("|---|---|---:|---:|---:|")
    for bits in args.bits:
        engines = {}
        for way, parts in [list(WAYS.items())[i] for i in args.ways]:
            with quantization(*parts):
                engines[way] = Engine(model, kv_budget_bytes=int(args.kv_gib * 2**30), kv_bits=bits,
                                      max_num_seqs=max(64, args.concurrency), enable_prefix_caching=False)
        results = {way: [] for way in engines}
        for round_ in range(args.rounds + 1):  # the first is a warm-up
            for way, engine in engines.items():
                with quantization(*WAYS[way]):
                    ttft, tps = one_stream(engine, prompt, args.new_tokens)
                    many = batch(engine, prompts, args.new_tokens)
                if round_:
                    results[way].append((ttft, tps, many))
        medians = {way: [statistics.median(r[i] for r in runs) for i in range(3)] for way, runs in results.items()}
        base = next(iter(medians.values()))
        for way, values in medians.items():
            cells = [f"{v:.3f}" if i == 0 else f"{v:.1f}" for i, v in enumerate(values)]
            if values is not base:
                cells = [f"{c} ({v / b:.2f}x)" for c, v, b in zip(cells, values, base)]
            print(f"| {bits} | {way} | " + " | ".join(cells) + " |", flush=True)

if __name__ == "__main__":
    main()
