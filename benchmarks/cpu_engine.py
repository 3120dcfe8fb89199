"""Aggregate decode throughput and KV fragmentation: this engine vs mlx-lm, in one process.

Usage (OpenBLAS preloaded, see README):
    python benchmarks/cpu_engine.py [--model PATH] [--concurrency 1 4 16 64] [--new-tokens 128]

Every request generates exactly ``--new-tokens`` tokens (EOS ignored) in all
three systems, so the token counts are equal and only the time differs.
"""

import argparse
import platform
import random
import sys
import time
from pathlib import Path

import mlx.core as mx
from mlx_lm.generate import BatchGenerator, generate_step
from mlx_lm.models.cache import BatchKVCache, make_prompt_cache

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from llm_paged_mlx import Engine, SamplingParams  # noqa: E402
from llm_paged_mlx.models.loading import load_model  # noqa: E402

QUESTIONS = [
    "What is the capital of France?",
    "Explain photosynthesis in one paragraph.",
    "Write a haiku about the sea.",
    "List three uses of copper and say why each works.",
    "How do vaccines train the immune system? Answer for a ten-year-old.",
    "Summarize the plot of Romeo and Juliet.",
    "What is the difference between weather and climate?",
    "Give me a recipe for pancakes with exact quantities, then explain each step.",
]


def prompts_for(tokenizer, n):
    return [
        tokenizer.apply_chat_template([{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)] + f" (#{i})"}], add_generation_prompt=True)
        for i in range(n)
    ]


def time_engine(model, tokenizer, prompts, new_tokens):
    engine = Engine(model, tokenizer, max_num_seqs=max(len(prompts), 1), enable_prefix_caching=False)
    params = SamplingParams(max_tokens=new_tokens, ignore_eos=True)
    start = time.perf_counter()
    outs = engine.generate(prompts, params)
    elapsed = time.perf_counter() - start
    return sum(len(o.token_ids) for o in outs) / elapsed


def time_sequential(model, prompts, new_tokens):
    start = time.perf_counter()
    count = 0
    for prompt in prompts:
        for _ in generate_step(mx.array(prompt), model, max_tokens=new_tokens, sampler=lambda x: mx.argmax(x, -1)):
            count += 1
    return count / (time.perf_counter() - start)


def time_batch_generator(model, prompts, new_tokens):
    gen = BatchGenerator(model, stop_tokens=[], completion_batch_size=max(len(prompts), 32))
    start = time.perf_counter()
    gen.insert(prompts, [new_tokens] * len(prompts))
    count = 0
    while responses := gen.next_generated():
        count += len(responses)
    elapsed = time.perf_counter() - start
    gen.close()
    return count / elapsed


def fragmentation(model, tokenizer, block_size=16, count=16, seed=0):
    """KV bytes allocated vs the bytes the tokens need, for a mixed-length batch."""
    rng = random.Random(seed)
    vocab = model.args.vocab_size
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(8, 900))] for _ in range(count)]
    engine = Engine(model, max_num_seqs=count, enable_prefix_caching=False, block_size=block_size)
    per_token = engine.runner.kv.nbytes // (engine.blocks.num_blocks * block_size)
    ids = [engine.add_request(p, SamplingParams(max_tokens=1000)) for p in prompts]
    while any(engine.requests[i].num_computed < len(p) for i, p in zip(ids, prompts)):
        engine.step()
    tokens = sum(engine.requests[i].num_computed for i in ids)
    paged = engine.stats()["used_blocks"] * block_size * per_token
    for i in ids:
        engine.abort(i)

    single = 0
    for p in prompts:
        cache = make_prompt_cache(model)
        model(mx.array(p)[None], cache=cache)
        mx.eval([c.state for c in cache])
        single += sum(c.nbytes for c in cache)
    longest = max(len(p) for p in prompts)
    padded = mx.array([[0] * (longest - len(p)) + p for p in prompts])
    caches = [BatchKVCache([longest - len(p) for p in prompts]) for _ in model.layers]
    model(padded, cache=caches)
    mx.eval([c.state for c in caches])
    batch = sum(c.nbytes for c in caches)
    need = tokens * per_token
    return {
        "sequences": count,
        "tokens": tokens,
        "needed_MB": need / 1e6,
        "paged_MB": paged / 1e6,
        "paged_waste_blocks_per_seq": (paged - need) / (block_size * per_token) / count,
        "KVCache_MB": single / 1e6,
        "BatchKVCache_MB": batch / 1e6,
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default=None, help="mlx-lm folder (default: the converted SmolLM2)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--sequential-requests", type=int, default=2)
    args = parser.parse_args()
    if args.model is None:
        from smollm2 import smollm2_dir

        args.model = str(smollm2_dir())
    model, tokenizer = load_model(args.model, dequantize=True, dtype="float32")
    print(f"# {platform.machine()} {platform.processor() or ''}, mlx {mx.__version__}, device {mx.default_device()}")
    print(f"# {time.strftime('%Y-%m-%d')}, model {Path(args.model).name}, {args.new_tokens} new tokens per request")
    warm = prompts_for(tokenizer, 2)  # first runs allocate and load what later runs reuse
    print(f"warm-up: engine {time_engine(model, tokenizer, warm, 8):.1f} tok/s, "
          f"BatchGenerator {time_batch_generator(model, warm, 8):.1f} tok/s")
    seq = time_sequential(model, prompts_for(tokenizer, args.sequential_requests), args.new_tokens)
    print(f"{'requests':>8} {'engine tok/s':>13} {'BatchGen tok/s':>15} {'sequential':>11} {'vs BatchGen':>12} {'vs seq':>7}")
    for n in args.concurrency:
        prompts = prompts_for(tokenizer, n)
        ours = time_engine(model, tokenizer, prompts, args.new_tokens)
        batch = time_batch_generator(model, prompts, args.new_tokens)
        print(f"{n:>8} {ours:>13.1f} {batch:>15.1f} {seq:>11.1f} {ours / batch:>11.2f}x {ours / seq:>6.2f}x", flush=True)
    print("fragmentation:", {k: round(v, 2) if isinstance(v, float) else v for k, v in fragmentation(model, tokenizer).items()})


if __name__ == "__main__":
    main()
