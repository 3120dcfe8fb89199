"""Engine vs mlx-lm BatchGenerator on a random-weight Qwen3-0.6B-shaped model, in one process.

Meant for a GPU (the H200 runs it through MLX's CUDA backend); it also runs on
the CPU with ``--small``. Every request generates exactly ``--new-tokens``
tokens (EOS ignored), so only time differs between the systems; each system
runs each workload twice and the second, warm run is reported.

    python benchmarks/engine_throughput.py [--concurrency 1 16 64] [--kernels auto portable]
"""

import argparse
import random
import time

import mlx.core as mx
from mlx.utils import tree_map
from mlx_lm.generate import BatchGenerator, generate_step
from mlx_lm.models import qwen3

from llm_paged_mlx import Engine, SamplingParams

QWEN3_0_6B = dict(
    model_type="qwen3", hidden_size=1024, num_hidden_layers=28, intermediate_size=3072,
    num_attention_heads=16, num_key_value_heads=8, head_dim=128, vocab_size=151936,
    rope_theta=1_000_000.0, max_position_embeddings=40960, rms_norm_eps=1e-6, tie_word_embeddings=True,
)
SMALL = dict(QWEN3_0_6B, hidden_size=256, num_hidden_layers=4, intermediate_size=512,
             num_attention_heads=4, num_key_value_heads=2, head_dim=64, vocab_size=4096)


def build_model(config, dtype):
    mx.random.seed(0)
    model = qwen3.Model(qwen3.ModelArgs(**config))
    model.update(tree_map(lambda p: p.astype(dtype), model.parameters()))
    mx.eval(model.parameters())
    return model


def prompts_for(n, vocab, seed=0, low=32, high=160):
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(rng.randint(low, high))] for _ in range(n)]


def engine_tps(model, prompts, new_tokens, kernel):
    engine = Engine(model, max_num_seqs=max(64, len(prompts)), attention_kernel=kernel, enable_prefix_caching=False)
    engine.generate(prompts[:2], SamplingParams(max_tokens=4, ignore_eos=True))  # warm-up
    start = time.perf_counter()
    outs = engine.generate(prompts, SamplingParams(max_tokens=new_tokens, ignore_eos=True))
    return sum(len(o.token_ids) for o in outs) / (time.perf_counter() - start), engine.kernel.name


def batch_generator_tps(model, prompts, new_tokens):
    gen = BatchGenerator(model, stop_tokens=[], completion_batch_size=max(32, len(prompts)))
    start = time.perf_counter()
    gen.insert(prompts, [new_tokens] * len(prompts))
    count = 0
    while responses := gen.next_generated():
        count += len(responses)
    gen.close()
    return count / (time.perf_counter() - start)


def single_stream_tps(model, prompt, new_tokens):
    start = time.perf_counter()
    count = sum(1 for _ in generate_step(mx.array(prompt), model, max_tokens=new_tokens))
    return count / (time.perf_counter() - start)


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--kernels", nargs="+", default=["auto", "portable"])
    parser.add_argument("--small", action="store_true", help="a 4-layer model, for the CPU")
    args = parser.parse_args()
    dtype = mx.float32 if args.small else mx.bfloat16
    model = build_model(SMALL if args.small else QWEN3_0_6B, dtype)
    vocab = model.args.vocab_size
    print(f"# mlx {mx.__version__} on {mx.default_device()}, {time.strftime('%Y-%m-%d')}, "
          f"{'small' if args.small else 'Qwen3-0.6B-shaped'} {dtype}, {args.new_tokens} new tokens per request")
    single_stream_tps(model, prompts_for(1, vocab)[0], 8)
    print(f"one stream (mlx-lm generate_step): {single_stream_tps(model, prompts_for(1, vocab)[0], args.new_tokens):.1f} tok/s")
    header = f"{'requests':>8} {'BatchGen':>9}" + "".join(f" {k:>10} {'ratio':>6}" for k in args.kernels)
    print(header)
    for n in args.concurrency:
        prompts = prompts_for(n, vocab, seed=n)
        # Each system runs the workload twice and the second run counts: the first pays for
        # compiling kernels and plans for the workload's shapes (on the GPU, seconds).
        base = [batch_generator_tps(model, prompts, args.new_tokens) for _ in range(2)][-1]
        row = f"{n:>8} {base:>9.1f}"
        for kernel in args.kernels:
            tps, name = [engine_tps(model, prompts, args.new_tokens, kernel) for _ in range(2)][-1]
            row += f" {tps:>10.1f} {tps / base:>5.2f}x"
        print(row, flush=True)


if __name__ == "__main__":
    main()
