"""Engine vs mlx-lm BatchGenerator on a random-weight Qwen3-0.6B-shaped model, in one process.

``--model llama-8b`` takes a Llama-3.1-8B-shaped model instead, ``--bits 4`` any model with 4-bit
weights (group 64). ``--model deepseek-v2-lite`` takes a DeepSeek-V2-Lite-shaped model instead (27
layers, 16 heads, latent 512 + RoPE 64, 64 routed experts of which 6 per token
and 2 shared) in mlx-lm's ``deepseek_v3`` module, which caches the latent
(``deepseek_v2`` caches full per-head K/V): multi-head latent attention.
``--model gpt-oss-20b`` a gpt-oss-20b-shaped one (24 layers alternating a
128-token window and full attention, attention sinks, 32 experts of which 4 per
token). ``--model qwen3.5-27b`` a Qwen3.5-27B-shaped hybrid (64 layers: three
gated-delta-net layers, then one of gated full attention; the recurrent layers'
head counts, 16 key and 48 value heads of 128, are assumed), whose recurrent
state takes slots of the engine's budget.

Meant for a GPU (the H200 runs it through MLX's CUDA backend); it also runs on
the CPU with ``--small``. Every request generates exactly ``--new-tokens``
tokens (EOS ignored), so only time differs between the systems. Each system
runs each workload once to warm up, then ``--rounds`` times in alternation with
the others (the engine on one Engine, as a server would); medians are reported.
The engine's K/V pool holds ``--kv-gib`` GiB (the default holds every workload
here, so nothing is preempted; BatchGenerator grows its caches as it needs);
preemptions are printed if any happen. Before each workload's row it prints the seconds each engine
took to build and each system's warm-up run took (kernels compiled at first use, step traces).

    python benchmarks/engine_throughput.py [--concurrency 1 16 64] [--kernels auto portable] [--eager]
        [--prompt-tokens 32 160]

``--eager`` adds a column per kernel with compiled steps turned off. ``--timeline`` runs each engine once more
step by step and prints where that run's time went. ``--apart`` runs BatchGenerator's warm-up and rounds first
and builds the engines after it (no alternation): for a card whose memory does not hold both systems' K/V at
once (256 requests at 8B in bf16 on an 80 GB H100). ``--freeze-heap`` times the rounds with the heap the process
holds after the warm-ups out of Python's full garbage collections (``gc.freeze()``), as ``llm paged-mlx serve``
runs: both systems' rounds alike.
"""

import argparse
import contextlib
import gc
import random
import statistics
import time

import mlx.core as mx
import mlx.nn as nn
from long_context import LLAMA_8B, SMALL as LLAMA_SMALL  # this folder
from mlx.utils import tree_map
from mlx_lm.generate import BatchGenerator, generate_step
from mlx_lm.models import deepseek_v3, gpt_oss, llama, qwen3, qwen3_5

from llm_paged_mlx import Engine, SamplingParams

QWEN3_0_6B = dict(
    model_type="qwen3", hidden_size=1024, num_hidden_layers=28, intermediate_size=3072,
    num_attention_heads=16, num_key_value_heads=8, head_dim=128, vocab_size=151936,
    rope_theta=1_000_000.0, max_position_embeddings=40960, rms_norm_eps=1e-6, tie_word_embeddings=True,
)
SMALL = dict(QWEN3_0_6B, hidden_size=256, num_hidden_layers=4, intermediate_size=512,
             num_attention_heads=4, num_key_value_heads=2, head_dim=64, vocab_size=4096)
DEEPSEEK_V2_LITE = dict(
    model_type="deepseek_v3", vocab_size=102400, hidden_size=2048, intermediate_size=10944,
    moe_intermediate_size=1408, num_hidden_layers=27, num_attention_heads=16, num_key_value_heads=16,
    n_shared_experts=2, n_routed_experts=64, num_experts_per_tok=6, first_k_dense_replace=1,
    kv_lora_rank=512, q_lora_rank=None, qk_rope_head_dim=64, v_head_dim=128, qk_nope_head_dim=128,
    topk_method="noaux_tc", scoring_func="softmax", norm_topk_prob=False, max_position_embeddings=163840,
)
DEEPSEEK_SMALL = dict(DEEPSEEK_V2_LITE, vocab_size=4096, hidden_size=256, intermediate_size=512,
                      moe_intermediate_size=128, num_hidden_layers=4, n_routed_experts=8, num_experts_per_tok=2)
GPT_OSS_20B = dict(
    model_type="gpt_oss", num_hidden_layers=24, num_local_experts=32, num_experts_per_tok=4, vocab_size=201088,
    hidden_size=2880, intermediate_size=2880, head_dim=64, num_attention_heads=64, num_key_value_heads=8,
    sliding_window=128, rope_theta=150000, layer_types=["sliding_attention", "full_attention"] * 12,
)
GPT_OSS_SMALL = dict(GPT_OSS_20B, num_hidden_layers=4, num_local_experts=8, num_experts_per_tok=2, vocab_size=4096,
                     hidden_size=256, intermediate_size=256, num_attention_heads=8, num_key_value_heads=2,
                     layer_types=["sliding_attention", "full_attention"] * 2)
QWEN3_5_27B_TEXT = dict(
    model_type="qwen3_5_text", hidden_size=5120, num_hidden_layers=64, intermediate_size=17408,
    num_attention_heads=24, num_key_value_heads=4, head_dim=256, vocab_size=248320, linear_num_key_heads=16,
    linear_num_value_heads=48, linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4,
    full_attention_interval=4, rms_norm_eps=1e-6, tie_word_embeddings=False, max_position_embeddings=262144,
)
QWEN3_5_27B = dict(model_type="qwen3_5", text_config=QWEN3_5_27B_TEXT)
QWEN3_5_SMALL = dict(model_type="qwen3_5", text_config=dict(
    QWEN3_5_27B_TEXT, hidden_size=256, num_hidden_layers=4, intermediate_size=512, num_attention_heads=4,
    num_key_value_heads=2, head_dim=64, vocab_size=4096, linear_num_key_heads=2, linear_num_value_heads=4,
    linear_key_head_dim=64, linear_value_head_dim=64,
))
MODELS = {  # name: (module, config, --small config)
    "qwen3-0.6b": (qwen3, QWEN3_0_6B, SMALL),
    "llama-8b": (llama, LLAMA_8B, LLAMA_SMALL),
    "deepseek-v2-lite": (deepseek_v3, DEEPSEEK_V2_LITE, DEEPSEEK_SMALL),
    "gpt-oss-20b": (gpt_oss, GPT_OSS_20B, GPT_OSS_SMALL),
    "qwen3.5-27b": (qwen3_5, QWEN3_5_27B, QWEN3_5_SMALL),
}


def build_model(module, config, dtype, bits=None, evaluate=True):
    """A random-weight model (seeded: every call gives the same weights), with ``bits``-bit weights (group 64);
    without ``evaluate`` its weights stay lazy (a tensor-parallel engine evaluates only its rank's shard)."""
    mx.random.seed(0)
    model = module.Model(module.ModelArgs(**config))
    model.update(tree_map(lambda p: p.astype(dtype), model.parameters()))
    if bits:
        nn.quantize(model, group_size=64, bits=bits)
    if evaluate:
        mx.eval(model.parameters())
    return model


def prompts_for(n, vocab, seed=0, low=32, high=160):
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(rng.randint(low, high))] for _ in range(n)]


def engine_runner(model, prompts, new_tokens, kernel, compile_steps, kv_bytes, verify_model=True):
    """A function that runs the workload on one engine (kept, as a server would) and returns tokens/s."""
    engine = Engine(
        model,
        kv_budget_bytes=kv_bytes,
        max_num_seqs=max(64, len(prompts)),
        attention_kernel=kernel,
        enable_prefix_caching=False,
        compile_steps=compile_steps,
        verify_model=verify_model,
    )
    params = SamplingParams(max_tokens=new_tokens, ignore_eos=True)

    def run():
        start = time.perf_counter()
        outs = engine.generate(prompts, params)
        return sum(len(o.token_ids) for o in outs) / (time.perf_counter() - start)

    run.engine = engine
    return run


def engine_timeline(engine, prompts, new_tokens) -> str:
    """One more run of the workload, step by step: where its time went (the prompts' phase, until every request
    has a token, against the steady decoding after it; the slowest steps). ``Engine.step`` returns the tokens of
    the step before it, so a step's time is counted with the tokens of the one before."""
    params = SamplingParams(max_tokens=new_tokens, ignore_eos=True)
    start = time.perf_counter()
    without_token = {engine.add_request(prompt, params) for prompt in prompts}
    steps = []  # (seconds, tokens, whether a request had no token yet)
    while engine.has_unfinished():
        began, prompts_phase = time.perf_counter(), bool(without_token)
        chunks = engine.step()
        steps.append((time.perf_counter() - began, sum(len(c.token_ids) for c in chunks), prompts_phase))
        without_token -= {c.request_id for c in chunks if c.token_ids}
    total = time.perf_counter() - start
    first, then = [s for s in steps if s[2]], [s for s in steps if not s[2]]
    decode_seconds = sum(s[0] for s in then)
    slowest = sorted(range(len(steps)), key=lambda i: -steps[i][0])[:3]
    decoding = (f"{len(then)} steps, {decode_seconds:.2f} s, median {statistics.median(s[0] for s in then) * 1e3:.2f} "
                f"ms ({sum(s[1] for s in then) / decode_seconds:.0f} tok/s)") if then and decode_seconds else "none"
    return (f"timeline: {total:.2f} s, {len(steps)} steps; until every request had a token {len(first)} steps, "
            f"{sum(s[0] for s in first):.2f} s; then {decoding}; slowest steps (index: ms) "
            + ", ".join(f"{i}: {steps[i][0] * 1e3:.1f}" for i in slowest))


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


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", choices=MODELS, default="qwen3-0.6b")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--kernels", nargs="+", default=["auto", "portable"])
    parser.add_argument("--small", action="store_true", help="a 4-layer model, for the CPU")
    parser.add_argument("--bits", type=int, choices=[4], default=None, help="quantize the weights (group 64)")
    parser.add_argument("--eager", action="store_true", help="also run each kernel without compiled steps")
    parser.add_argument(
        "--no-verify", action="store_true",
        help="skip the model check (a random MoE model's expert choices can flip on rounding alone)",
    )
    parser.add_argument("--rounds", type=int, default=3, help="timed runs per system (median reported)")
    parser.add_argument("--kv-gib", type=float, default=8, help="the engine's K/V pool, GiB")
    parser.add_argument("--prompt-tokens", type=int, nargs=2, default=[32, 160], metavar=("LOW", "HIGH"),
                        help="each prompt's length is drawn between these")
    parser.add_argument("--timeline", action="store_true",
                        help="then one more run of each engine step by step: its prompts' phase, its steady steps")
    parser.add_argument("--apart", action="store_true",
                        help="BatchGenerator's runs first, then the engines' (a card too small for both at once)")
    parser.add_argument("--freeze-heap", action="store_true", help="time the rounds as the server runs: gc.freeze()")
    args = parser.parse_args(argv)
    dtype = mx.float32 if args.small else mx.bfloat16
    module, config, small = MODELS[args.model]
    config = small if args.small else config
    model = build_model(module, config, dtype, args.bits)
    baseline = build_model(module, config, dtype, args.bits)  # mlx-lm's own: a GPU engine merges its projections
    vocab = (config.get("text_config") or config)["vocab_size"]
    weights = f", {args.bits}-bit weights" if args.bits else ""
    print(f"# mlx {mx.__version__} on {mx.default_device()}, {time.strftime('%Y-%m-%d')}, "
          f"{'small ' if args.small else ''}{args.model}-shaped {dtype}{weights}, prompts of {args.prompt_tokens[0]}-"
          f"{args.prompt_tokens[1]} tokens, {args.new_tokens} new tokens per request")
    runner = Engine(model, num_blocks=4, verify_model=False).runner
    print(f"K/V bytes per token in the engine's pool: {sum(l.bytes_per_token() for l in runner.spec.attention):,}")
    if runner.spec.states:
        per_sequence = sum(layout.bytes_per_sequence for layout in runner.spec.states)
        print(f"recurrent state bytes per sequence: {per_sequence:,}")
    del runner
    single_stream_tps(baseline, prompts_for(1, vocab)[0], 8)
    one = single_stream_tps(baseline, prompts_for(1, vocab)[0], args.new_tokens)
    print(f"one stream (mlx-lm generate_step): {one:.1f} tok/s")
    columns = [(k, True) for k in args.kernels] + [(k, False) for k in args.kernels if args.eager]
    header = f"{'requests':>8} {'BatchGen':>9}" + "".join(
        f" {k + ('' if c else '/eager'):>14} {'ratio':>6}" for k, c in columns
    )
    print(header)
    for n in args.concurrency:
        compare(n, prompts_for(n, vocab, n, *args.prompt_tokens), model, baseline, columns, args)
        gc.collect()  # this workload's engines (which hold reference cycles) are gone: their pools go back
        mx.clear_cache()


@contextlib.contextmanager
def frozen_heap(freeze: bool):
    """With ``freeze``, what the process holds now out of Python's full collections meanwhile, as the server keeps
    its heap (``engine.loop.freeze_heap``, which the server calls)."""
    frozen = False
    if freeze:
        from llm_paged_mlx.engine.loop import freeze_heap

        frozen = freeze_heap()
    try:
        yield
    finally:
        if frozen:
            gc.unfreeze()


def compare(n, prompts, model, baseline, columns, args):
    """One row of the table: BatchGenerator and each engine on ``prompts``, a warm-up run each (compiling
    kernels, plans and step traces for the workload's shapes), then ``--rounds`` runs in alternation, so drift
    of a shared machine hits all alike; with ``--apart`` BatchGenerator's runs come first, and the engines are
    built once its memory is given back."""
    seconds, tps = {}, {}  # seconds to build each engine and to warm each system up: where a slow first run went

    def warm_up(systems):
        for name, run in systems.items():
            start = time.perf_counter()
            run()
            seconds[f"{name} warm-up"] = time.perf_counter() - start

    def timed(systems):
        for name in systems:
            tps[name] = []
        with frozen_heap(args.freeze_heap):
            for _ in range(args.rounds):
                for name, run in systems.items():
                    tps[name].append(run())

    systems = {"BatchGen": lambda: batch_generator_tps(baseline, prompts, args.new_tokens)}
    if args.apart:
        warm_up(systems)
        timed(systems)
        gc.collect()
        mx.clear_cache()
        systems = {}
    for kernel, compile_steps in columns:
        name, start = kernel + ("" if compile_steps else "/eager"), time.perf_counter()
        systems[name] = engine_runner(
            model, prompts, args.new_tokens, kernel, compile_steps, int(args.kv_gib * 2**30), not args.no_verify
        )
        seconds[f"{name} built"] = time.perf_counter() - start
    warm_up(systems)
    print(f"{n} requests, seconds: " + ", ".join(f"{k} {v:.1f}" for k, v in seconds.items()), flush=True)
    timed(systems)
    median = {name: statistics.median(t) for name, t in tps.items()}
    base = median.pop("BatchGen")
    row = f"{n:>8} {base:>9.1f}" + "".join(f" {v:>14.1f} {v / base:>5.2f}x" for v in median.values())
    preempted = {name: run.engine.stats()["preemptions"] for name, run in systems.items() if hasattr(run, "engine")}
    print(row + "".join(f"  ({name}: {p} preemptions)" for name, p in preempted.items() if p), flush=True)
    if args.timeline:
        for name, run in systems.items():
            if hasattr(run, "engine"):
                print(f"  {name} {engine_timeline(run.engine, prompts, args.new_tokens)}", flush=True)


if __name__ == "__main__":
    main()
