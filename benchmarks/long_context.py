"""Long context in a fixed memory budget: a GPU with ``mx.set_memory_limit`` standing in for a 16 GB Mac.

A Llama-3.1-8B-shaped model with random 4-bit weights (``nn.quantize``, group
64) takes long prompts and decodes 128 tokens, with MLX's memory limit at
``--limit-gib``. For mlx-lm (``generate_step`` with its ``KVCache``) and for
this engine at full precision, 8 and 4 bits (``kv_budget_bytes="auto"``,
``memory_fraction=1``), it finds the largest context that fits: prefill plus
the decoded tokens with peak memory (``mx.get_peak_memory``) under the limit.
mlx-lm is run at growing lengths until one does not fit; the engine's pool is sized at
start, so its largest context is what the pool holds, and it is run at that
length. Then the engine with 4-bit K/V takes a 128K-token prompt, and a
8K-token one for the decode rate it keeps at 128K. Each row: context, prefill
tokens/s, decode tokens/s, peak memory.

    python benchmarks/long_context.py [--limit-gib 16] [--small] [--part long|largest]

``--small`` runs a 4-layer model with a 1 GiB limit (a smoke test, or the CPU).
``--part`` runs only the long-prompt rows or only the largest-context rows
(each part builds the model and its engines anew).
"""

import argparse
import gc
import time

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_map
from mlx_lm.generate import generate_step
from mlx_lm.models import llama

from llm_paged_mlx import Engine, SamplingParams

LLAMA_8B = dict(
    model_type="llama", hidden_size=4096, num_hidden_layers=32, intermediate_size=14336,
    num_attention_heads=32, num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0,
    max_position_embeddings=1 << 20, rms_norm_eps=1e-5, tie_word_embeddings=False,
)  # fmt: skip
SMALL = dict(LLAMA_8B, hidden_size=1024, num_hidden_layers=4, intermediate_size=2048, vocab_size=8192,
             num_attention_heads=8, num_key_value_heads=2)
NEW_TOKENS = 128
GIB = 2**30


def build_model(config):
    mx.random.seed(0)
    model = llama.Model(llama.ModelArgs(**config))
    model.update(tree_map(lambda p: p.astype(mx.bfloat16), model.parameters()))
    nn.quantize(model, group_size=64, bits=4)
    mx.eval(model.parameters())
    return model


def fresh():
    gc.collect()
    mx.clear_cache()
    mx.reset_peak_memory()


def prompt_of(length, vocab):
    return mx.random.randint(0, vocab, (length,), key=mx.random.key(length)).tolist()


def run_mlx_lm(model, length, vocab):
    """mlx-lm with its KVCache: (prefill tok/s, decode tok/s, peak bytes); None if it failed."""
    fresh()
    prompt = mx.array(prompt_of(length, vocab))
    start = time.perf_counter()
    try:
        first = None
        for count, _ in enumerate(generate_step(prompt, model, max_tokens=NEW_TOKENS, prefill_step_size=2048)):
            if first is None:
                first = time.perf_counter()
    except RuntimeError as e:  # out of memory
        print(f"  mlx-lm at {length}: {e}")
        return None
    end = time.perf_counter()
    return length / (first - start), count / (end - first), mx.get_peak_memory()


def run_engine(engine, length, vocab):
    """One request through the engine: (prefill tok/s, decode tok/s, peak bytes)."""
    mx.reset_peak_memory()
    params = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)
    start = time.perf_counter()
    first, count = None, 0
    for chunk in engine.stream(prompt_of(length, vocab), params):
        if chunk.token_ids and first is None:
            first = time.perf_counter()
        count += len(chunk.token_ids)
    end = time.perf_counter()
    assert count == NEW_TOKENS, count
    return length / (first - start), (count - 1) / (end - first), mx.get_peak_memory()


def row(name, length, result, limit):
    if result is None:
        print(f"| {name} | {length:,} | failed | | | |")
        return
    prefill, decode, peak = result
    fits = "yes" if peak <= limit else "NO"
    print(f"| {name} | {length:,} | {prefill:,.0f} | {decode:,.1f} | {peak / GIB:.2f} | {fits} |")


def largest_mlx_lm(model, vocab, limit, lengths):
    """The largest of ``lengths`` (ascending) that mlx-lm runs within ``limit``, stopping at the first that does not."""
    best = None
    for length in lengths:
        mx.set_memory_limit(limit)  # an engine built before lowers it
        result = run_mlx_lm(model, length, vocab)
        row("mlx-lm KVCache", length, result, limit)
        if result is None or result[2] > limit:
            break
        best = length
    return best


def engine_for(model, bits, limit, vocab, group_size=64):
    """An engine with the auto budget, warmed up (kernels compiled and checked) by a short request."""
    fresh()
    start = time.perf_counter()
    engine = Engine(model, kv_budget_bytes="auto", memory_fraction=1.0, kv_bits=bits, kv_group_size=group_size)
    built = time.perf_counter() - start
    engine.generate([prompt_of(3000, vocab)], SamplingParams(max_tokens=8, ignore_eos=True))
    capacity = engine.max_blocks - 1
    print(
        f"  engine kv_bits={bits}: built in {built:.2f} s, warmed up in {time.perf_counter() - start - built:.1f} s; "
        f"pool budget {engine.kv_budget_bytes / GIB:.2f} GiB, {capacity * engine.blocks.block_size:,} tokens"
    )
    return engine


def memory_note(engine):
    return (
        f"pool {engine.runner.kv.nbytes / GIB:.2f} GiB, active {mx.get_active_memory() / GIB:.2f} GiB, "
        f"cache {mx.get_cache_memory() / GIB:.2f} GiB"
    )


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--limit-gib", type=float, default=16.0)
    parser.add_argument("--small", action="store_true")
    parser.add_argument("--part", choices=["long", "largest"], help="only the long-prompt or largest-context rows")
    parser.add_argument("--mlx-lm-lengths", type=int, nargs="*", default=[16384, 24576, 32768, 40960, 49152])
    parser.add_argument("--bits", nargs="+", default=["bf16", "4", "8"], help="the engine's K/V for the largest context")
    parser.add_argument("--kv-group-size", type=int, default=64)
    parser.add_argument("--long", type=int, default=131072, help="the long prompt's tokens")
    args = parser.parse_args(argv)
    config = SMALL if args.small else LLAMA_8B
    limit = int((1 if args.small else args.limit_gib) * GIB)
    model = build_model(config)
    vocab = config["vocab_size"]
    print(f"device {mx.default_device()}, {mx.device_info()}, MLX {mx.__version__}")
    print(f"weights {mx.get_active_memory() / GIB:.2f} GiB; memory limit {limit / GIB:.1f} GiB")
    mx.set_memory_limit(limit)
    print("| system | context | prefill tok/s | decode tok/s | peak GiB | under the limit |")
    print("|---|---|---|---|---|---|")
    if args.part != "largest":
        engine = engine_for(model, 4, limit, vocab)
        for length in (8192, args.long):
            row("engine, K/V 4-bit", length, run_engine(engine, length, vocab), limit)
            print("  ", memory_note(engine))
        del engine
    if args.part == "long":
        return
    largest = {"mlx-lm": largest_mlx_lm(model, vocab, limit, args.mlx_lm_lengths)}
    for bits in [None if b == "bf16" else int(b) for b in args.bits]:
        engine = engine_for(model, bits, limit, vocab, args.kv_group_size)
        length = (engine.max_blocks - 1) * engine.blocks.block_size - NEW_TOKENS - 1
        result = run_engine(engine, length, vocab)
        row(f"engine, K/V {bits or 'bf16'}", length, result, limit)
        print("  ", memory_note(engine))
        if result[2] <= limit:
            largest[bits] = length
        del engine
    print("largest context within the limit:", {str(k): v for k, v in largest.items()})
    for bits in (8, 4):
        if largest.get(None) and largest.get(bits):
            print(f"  {bits}-bit / bf16: {largest[bits] / largest[None]:.2f}x")


if __name__ == "__main__":
    main()
