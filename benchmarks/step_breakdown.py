"""Where a decode step's time goes, for mlx-lm, BatchGenerator and the engine, in one process.

    PYTHONPATH=. python3 benchmarks/step_breakdown.py [--model deepseek-v2-lite] [--batch 64] [--kernel-profile]

A random-weight model of ``engine_throughput.py``'s shapes; ``--batch`` sequences of ``--context``
prompt tokens each, all decoding. Each line is a median after warm-up:

- mlx-lm forward: the model on ``(batch, 1)`` tokens over its own contiguous caches (``--steps`` calls);
- its MLPs alone, and its attention layers alone, on the same hidden states (every layer's);
- BatchGenerator: the time between two of its calls, over the last three quarters of a run of
  ``2 * steps + 8`` tokens (past the prompts' prefill);
- the engine: the time of one of its steps, likewise.

The "ceiling" line divides BatchGenerator's step by the MLPs' time: the most that any engine which runs
mlx-lm's own MLPs could gain over BatchGenerator at this shape, were its attention and everything else
free. ``--kernel-profile`` then lists the GPU kernels of ``--steps`` engine steps by time, through
PyTorch's profiler when it is importable (it records every kernel of the process, MLX's included).
"""

import argparse
import statistics
import time

import mlx.core as mx
from engine_throughput import MODELS, build_model, prompts_for  # this folder
from mlx_lm.generate import BatchGenerator
from mlx_lm.models.cache import make_prompt_cache

from llm_paged_mlx import Engine, SamplingParams


def median_ms(run, steps, warm=3):
    for _ in range(warm):
        run()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def mlx_lm_parts(model, prompts, steps):
    """Milliseconds of mlx-lm's forward over a (batch, 1) step, of its MLPs, and of its attention layers."""
    cache = make_prompt_cache(model)
    mx.eval(model(mx.array(prompts), cache=cache))
    tokens = mx.array([[p[-1]] for p in prompts])
    forward = median_ms(lambda: mx.eval(model(tokens, cache=cache)), steps)
    norm = model.layers[0].input_layernorm.weight  # its width and dtype are the hidden states'
    hidden = mx.random.normal((len(prompts), 1, norm.shape[0])).astype(norm.dtype)
    layers = list(zip(model.layers, cache))
    mlps = median_ms(lambda: mx.eval([layer.mlp(hidden) for layer, _ in layers]), steps)
    attended = [(layer.self_attn, c) for layer, c in layers if hasattr(layer, "self_attn")]
    attention = median_ms(lambda: mx.eval([attn(hidden, None, c) for attn, c in attended]), steps)
    return forward, mlps, attention


def batch_generator_step(model, prompts, steps):
    gen = BatchGenerator(model, stop_tokens=[], completion_batch_size=len(prompts))
    gen.insert(prompts, [2 * steps + 8] * len(prompts))
    times = []
    while True:
        start = time.perf_counter()
        if not gen.next_generated():
            break
        times.append(time.perf_counter() - start)
    gen.close()
    return 1000 * statistics.median(times[len(times) // 4 :])  # past the prompts' prefill


def engine_step(engine, prompts, steps, profiler=None):
    """The median step in steady decoding; ``profiler`` (a context manager) records ``steps`` of them, from the
    step after every request has its first token (before it, steps of many requests still run prompts)."""
    params = SamplingParams(max_tokens=2 * steps + 8, ignore_eos=True)
    without_token = {engine.add_request(prompt, params) for prompt in prompts}
    times, profiled = [], None
    while engine.has_unfinished():
        if profiler is not None and profiled is None and not without_token:
            profiler.__enter__()
            profiled = 0
        start = time.perf_counter()
        chunks = engine.step()
        times.append(time.perf_counter() - start)
        without_token -= {c.request_id for c in chunks if c.token_ids}
        if profiled is not None and (profiled := profiled + 1) == steps:
            mx.synchronize()
            profiler.__exit__(None, None, None)
    return 1000 * statistics.median(times[len(times) // 4 :])


def kernel_table(steps, name="engine"):
    """A profiler over ``steps`` steps of ``name``, and a function printing its kernels by time; None without
    PyTorch."""
    try:
        from torch.profiler import ProfilerActivity, profile
    except ImportError:
        print("(no kernel profile: PyTorch is not importable)")
        return None, None
    profiler = profile(activities=[ProfilerActivity.CUDA])

    def show(rows=25):
        events = [e for e in profiler.key_averages() if e.self_device_time_total > 0]
        total = sum(e.self_device_time_total for e in events)
        launches = sum(e.count for e in events) / steps
        print(f"GPU kernels of {steps} {name} steps: {total / 1000 / steps:.2f} ms of kernel time and "
              f"{launches:.0f} kernels per step")
        print(f"{'kernel':<72} {'ms/step':>8} {'share':>6} {'calls/step':>10}")
        for e in sorted(events, key=lambda e: -e.self_device_time_total)[:rows]:
            print(f"{e.key[:72]:<72} {e.self_device_time_total / 1000 / steps:>8.3f} "
                  f"{e.self_device_time_total / total:>6.1%} {e.count / steps:>10.1f}")

    return profiler, show


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", choices=MODELS, default="deepseek-v2-lite")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--context", type=int, default=128, help="prompt tokens per sequence")
    parser.add_argument("--steps", type=int, default=20, help="timed calls per line")
    parser.add_argument("--small", action="store_true", help="a 4-layer model, for the CPU")
    parser.add_argument("--kernel-profile", action="store_true")
    args = parser.parse_args(argv)
    module, config, small = MODELS[args.model]
    config = small if args.small else config
    model = build_model(module, config, mx.float32 if args.small else mx.bfloat16)
    vocab = (config.get("text_config") or config)["vocab_size"]
    prompts = prompts_for(args.batch, vocab, 0, args.context, args.context)
    print(f"# mlx {mx.__version__} on {mx.default_device()}, {time.strftime('%Y-%m-%d')}, "
          f"{'small ' if args.small else ''}{args.model}-shaped, {args.batch} sequences of {args.context} prompt tokens")

    forward, mlps, attention = mlx_lm_parts(model, prompts, args.steps)
    batch_generator_step(model, prompts, args.steps)  # warm-up
    batch_gen = batch_generator_step(model, prompts, args.steps)
    engine = Engine(model, kv_budget_bytes=16 << 30, max_num_seqs=args.batch,
                    max_num_batched_tokens=max(2048, args.batch * args.context), enable_prefix_caching=False,
                    verify_model=False)  # a random MoE model's expert choices can flip on rounding alone
    engine_step(engine, prompts, args.steps)  # warm-up: compiles kernels and step traces
    step = engine_step(engine, prompts, args.steps)
    print(f"mlx-lm forward, one step   {forward:8.2f} ms")
    print(f"  its MLPs alone           {mlps:8.2f} ms")
    print(f"  its attention alone      {attention:8.2f} ms")
    print(f"BatchGenerator, one step   {batch_gen:8.2f} ms")
    print(f"engine, one step           {step:8.2f} ms   ({batch_gen / step:.2f}x BatchGenerator)")
    print(f"ceiling over BatchGenerator with mlx-lm's MLPs: {batch_gen / mlps:.2f}x")
    if args.kernel_profile:
        profiler, show = kernel_table(args.steps)
        if profiler is not None:
            engine_step(engine, prompts, args.steps, profiler)
            show()


if __name__ == "__main__":
    main()
