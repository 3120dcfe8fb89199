"""Where a decode step's host time goes, the engine's against mlx-lm's own loop, in one process.

    PYTHONPATH=. python3 benchmarks/host_profile.py [--model llama-8b] [--bits 4] [--rows 1 16 64]

A random-weight model (``--model``: the Llama-3.1-8B or the Qwen3-0.6B shape, bf16, or with ``--bits``
4-bit weights, group 64; ``--small`` a 4-layer one for the CPU). For each number of concurrent requests
(prompts of 64-128 tokens, all decoding), the engine's steps are timed part by part, milliseconds a
step, medians over ``--steps`` steady steps after a warm-up:

- schedule: the scheduler's plan of the step;
- forward: building the step's graph (the traced model, its block tables and positions);
- sample: building its sampling;
- launch: ``mx.async_eval`` of the step (MLX encodes its kernels: the host's share of the device work);
- wait: until the step before it has ended and its tokens are read;
- apply: handing the tokens to their requests (stop rules, output chunks);
- step: one call of ``Engine.step``, all of it.

The same split for mlx-lm at one stream: a bare greedy loop over its model and ``KVCache`` in
``generate_step``'s order (its model call, ``async_eval``, reading a token), its time per token. Then
the engine at one stream with each step waited for before the next is built, and with the step built ahead
launched only after the one in flight is read. ``--kernel-profile ROWS`` lists the GPU kernels of
mlx-lm's loop and of the engine's steps at ROWS requests instead.
The budget a step has is the device's time: whatever host work is not hidden behind it is lost.
"""

import argparse
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import mlx.core as mx
from engine_throughput import QWEN3_0_6B, SMALL, build_model, prompts_for  # this folder
from long_context import LLAMA_8B
from mlx_lm.models import llama, qwen3
from mlx_lm.models.cache import make_prompt_cache
from one_stream import read_first
from step_breakdown import engine_step, kernel_table

from llm_paged_mlx import Engine, SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # smollm2.py: where the model is kept

MODELS = {"llama-8b": (llama, LLAMA_8B), "qwen3-0.6b": (qwen3, QWEN3_0_6B)}
PARTS = ("schedule", "forward", "sample", "launch", "wait", "apply")


class PartTimer:
    """Wraps methods so that each call's wall time adds to its part of the current step."""

    def __init__(self):
        self.current: dict[str, float] = defaultdict(float)
        self.steps: list[dict[str, float]] = []

    def wrap(self, owner, name: str, part: str):
        method = getattr(owner, name)

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                self.current[part] += time.perf_counter() - start

        setattr(owner, name, timed)

    def end_step(self, total: float) -> None:
        self.current["step"] = total
        self.steps.append(dict(self.current))
        self.current = defaultdict(float)

    def medians_ms(self, skip: int) -> dict[str, float]:
        steps = self.steps[skip:]
        return {part: 1000 * statistics.median(s.get(part, 0.0) for s in steps) for part in PARTS + ("step",)}


def batch_engine(model, rows: int) -> Engine:
    """An engine for ``rows`` requests of this benchmark's prompts (up to 128 tokens, then the steps)."""
    pool = max(4 * 2**30, rows * 32 * 2**20)  # 8B: 128 KiB of K/V a token, a request's few hundred tokens
    return Engine(model, kv_budget_bytes=pool, max_num_seqs=max(64, rows), enable_prefix_caching=False)


def engine_profile(model, prompts, steps: int) -> dict[str, float]:
    engine = batch_engine(model, len(prompts))
    timer = PartTimer()
    timer.wrap(engine.scheduler, "schedule", "schedule")
    timer.wrap(engine.runner, "forward", "forward")
    timer.wrap(engine.steps, "_sample", "sample")
    timer.wrap(engine.runner, "launch", "launch")
    timer.wrap(engine.steps, "wait", "wait")
    timer.wrap(engine.steps, "apply", "apply")
    params = SamplingParams(max_tokens=steps + 40, ignore_eos=True)
    for prompt in prompts:
        engine.add_request(prompt, params)
    while engine.has_unfinished():
        start = time.perf_counter()
        engine.step()
        timer.end_step(time.perf_counter() - start)
    # Past the prompts' prefill and the warm-up, before the last steps (which cannot run ahead).
    timer.steps = timer.steps[: -5]
    return timer.medians_ms(skip=len(timer.steps) - steps)


def one_stream_ms(engine, prompt, steps: int, wait_each: bool = False) -> float:
    """The median of ``steps`` steady steps of one request on ``engine`` (``wait_each``: each waited for)."""
    engine.add_request(prompt, SamplingParams(max_tokens=steps + 40, ignore_eos=True))
    times = []
    while engine.has_unfinished():
        start = time.perf_counter()
        engine.step()
        if wait_each:
            mx.synchronize()
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times[-steps - 5 : -5])


def read_first_ms(model, prompt, steps: int) -> float:
    """One stream, ms a step, with the step built ahead launched only after the one in flight is read (as the
    engine runs where a K/V write would copy a pool: a GPU's scatters): what launching it first gains."""
    engine = Engine(model, kv_budget_bytes=4 * 2**30, enable_prefix_caching=False)
    return one_stream_ms(read_first(engine), prompt, steps)


def mlx_lm_profile(model, prompt, steps: int, profiler=None) -> dict[str, float]:
    """A bare greedy loop over mlx-lm's model and cache in ``generate_step``'s order (the next token's graph
    built and launched before the current one is read), split into those parts; ``profiler`` (a context
    manager) records its last ``steps`` steps."""
    cache = make_prompt_cache(model)
    logits = model(mx.array(prompt)[None], cache=cache)[:, -1]
    token = mx.argmax(logits, axis=-1)
    mx.eval(token)
    parts = defaultdict(list)
    for step in range(steps + 10):
        if profiler is not None and step == 10:
            profiler.__enter__()
        t0 = time.perf_counter()
        logits = model(token[:, None], cache=cache)[:, -1]
        next_token = mx.argmax(logits, axis=-1)
        t1 = time.perf_counter()
        mx.async_eval(next_token)
        t2 = time.perf_counter()
        token.item()
        t3 = time.perf_counter()
        token = next_token
        for part, seconds in (("forward", t1 - t0), ("launch", t2 - t1), ("wait", t3 - t2), ("step", t3 - t0)):
            parts[part].append(seconds)
    if profiler is not None:
        token.item()
        profiler.__exit__(None, None, None)
    return {part: 1000 * statistics.median(values[10:]) for part, values in parts.items()}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=MODELS, default="llama-8b")
    parser.add_argument("--bits", type=int, choices=[4], default=None, help="quantize the weights (group 64)")
    parser.add_argument("--small", action="store_true", help="a 4-layer model, float32 (the CPU)")
    parser.add_argument("--smollm2", action="store_true", help="the real SmolLM2-135M, float32 (the CPU)")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--kernel-profile", type=int, metavar="ROWS", default=None,
                        help="then list the GPU kernels of the engine's steps at ROWS requests (needs PyTorch)")
    args = parser.parse_args()
    if args.smollm2:
        from smollm2 import smollm2_dir

        from llm_paged_mlx.models.loading import load_model

        model, _ = load_model(str(smollm2_dir()), dequantize=not args.bits, dtype="float32")
        name, layers, vocab = f"SmolLM2-135M, {f'its {args.bits}-bit GGUF' if args.bits else 'float32'} weights", \
            model.args.num_hidden_layers, model.args.vocab_size
    else:
        module, config = MODELS[args.model]
        config = SMALL if args.small else config
        model = build_model(module, config, mx.float32 if args.small else mx.bfloat16, args.bits)
        dtype = "float32" if args.small else "bf16"
        name = f"{'small ' if args.small else ''}{args.model}, {f'{args.bits}-bit' if args.bits else dtype} weights"
        layers, vocab = config["num_hidden_layers"], config["vocab_size"]
    print(f"# {time.strftime('%Y-%m-%d')}, mlx {mx.__version__} on {mx.default_device()}, {name}, "
          f"{layers} layers; ms per decode step, medians of {args.steps}")
    prompt = prompts_for(1, vocab, 1, 64, 128)[0]
    if args.kernel_profile:
        profiler, show = kernel_table(args.steps, "mlx-lm loop")
        if profiler is not None:
            mlx_lm_profile(model, prompt, 8)  # warm-up; then its steps at one stream, before any engine
            mlx_lm_profile(model, prompt, args.steps, profiler)
            show()
            profiler, show = kernel_table(args.steps)
            engine = batch_engine(model, args.kernel_profile)
            prompts = prompts_for(args.kernel_profile, vocab, args.kernel_profile, 64, 128)
            engine_step(engine, prompts, args.steps)  # warm-up
            engine_step(engine, prompts, args.steps, profiler)
            show()
        return
    mlx_lm_profile(model, prompt, 8)  # warm-up; before any engine, which on a GPU merges the model's projections
    theirs = mlx_lm_profile(model, prompt, args.steps)
    print("| system | rows | schedule | forward | sample | launch | wait | apply | step | tok/s |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    cells = [f"{theirs[p]:.2f}" if p in theirs else "" for p in PARTS]
    print(f"| mlx-lm loop | 1 | {' | '.join(cells)} | {theirs['step']:.2f} | {1000 / theirs['step']:.0f} |")
    for rows in args.rows:
        prompts = prompts_for(rows, vocab, rows, 64, 128)
        engine_profile(model, prompts, 8)  # warm-up: traces this shape's steps
        ours = engine_profile(model, prompts, args.steps)
        cells = [f"{ours[p]:.2f}" for p in PARTS]
        print(f"| engine | {rows} | {' | '.join(cells)} | {ours['step']:.2f} | {rows * 1000 / ours['step']:.0f} |",
              flush=True)
    alone = one_stream_ms(Engine(model, kv_budget_bytes=4 * 2**30, enable_prefix_caching=False), prompt,
                          args.steps, wait_each=True)
    print(f"\nengine, one stream, each step waited for before the next is built: {alone:.2f} ms a step")
    print(f"engine, one stream, the step built ahead launched after the one in flight is read: "
          f"{read_first_ms(model, prompt, args.steps):.2f} ms a step")

if __name__ == "__main__":
    main()
