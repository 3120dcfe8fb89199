"""One stream, the engine against mlx-lm's ``generate_step``, in one process: the number a user compares first.

    PYTHONPATH=. python3 benchmarks/one_stream.py [--models qwen3-0.6b llama-8b] [--bits none 4] [--smollm2]

For each random-weight model (bf16, or with ``--bits 4`` 4-bit weights, group 64), or with ``--smollm2``
the real SmolLM2-135M (float32, and ``--bits 4``: its 4-bit GGUF weights; the CPU's case), a prompt of
64-128 tokens (a new one each round, so the engine's prefix cache holds none of it) and ``--new-tokens`` new
tokens (EOS ignored): tokens
per second of the whole answer (its prefill included), mlx-lm's greedy ``generate_step`` and the engine
(one request on one ``Engine``, as ``llm -m`` runs it) in alternation, one warm-up each, medians of
``--rounds``. ``--timeline`` also prints where each system's time went in its last round: the first token,
the median gap between tokens, the 90th percentile and the largest, and the time lost to gaps over 1.5
times the median. ``--kernel-warps N`` also times, in the same alternation, a second engine over the same
model whose CUDA attention kernel keeps N simd groups a threadgroup whatever the step: a change
of a few percent shows within one process, where the spread between processes hides it. ``--rope-apart``
likewise times an engine over a second copy of the model whose decode steps rotate with the model's own RoPE
modules, not in the attention kernel (``models.deferred_rope``). ``--kernel-template FILE`` likewise times an
engine whose CUDA attention kernel is compiled from another template (a copy of ``csrc/paged_attention.in`` as it
was, say): a change to the kernel against the source before it, end to end. ``--read-first`` likewise times an
engine whose decode steps are launched only after the step in flight is read (as where a K/V write would copy a
pool that step holds), against the engine's own order. ``--interleave N``: within a round the systems take turns
every N tokens, and each one's rate is one over its median gap between tokens (prefill not counted): steady
decoding compared over the same minutes, for a machine whose speed drifts between answers.
"""

import argparse
import itertools
import statistics
import sys
import time
from pathlib import Path
from typing import Iterator

import mlx.core as mx
from engine_throughput import QWEN3_0_6B, SMALL, build_model, prompts_for  # this folder
from long_context import LLAMA_8B
from mlx_lm.generate import generate_step
from mlx_lm.models import llama, qwen3

from llm_paged_mlx import Engine, SamplingParams, plugins
from llm_paged_mlx.hookspecs import hookimpl
from llm_paged_mlx.kernels.fused import CudaKernel
from llm_paged_mlx.models.deferred_rope import DeferredRoPE

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


def mlx_lm_tokens(model, prompt, new_tokens: int) -> Iterator[int]:
    """One answer of mlx-lm's greedy ``generate_step``: yields 1 a token."""
    for _ in generate_step(mx.array(prompt), model, max_tokens=new_tokens, sampler=lambda x: mx.argmax(x, -1)):
        yield 1


def engine_tokens(engine, prompt, new_tokens: int) -> Iterator[int]:
    """One answer of ``engine``, read as ``llm -m`` reads it (``Engine.stream``): yields each chunk's tokens."""
    for chunk in engine.stream(prompt, SamplingParams(max_tokens=new_tokens, ignore_eos=True)):
        yield len(chunk.token_ids)


def token_times(answer: Iterator[int]) -> list[float]:
    """Seconds from the start to each token of one answer."""
    start, times = time.perf_counter(), []
    for count in answer:
        times += [time.perf_counter() - start] * count
    return times


SETTLING = 3  # a turn's first chunks, which come while the turn before it still ends on the device


def interleaved_gaps(answers: dict[str, Iterator[int]], turn: int, gaps: dict[str, list]) -> None:
    """The answers taking turns, ``turn`` chunks each: adds each one's seconds a token, chunk by chunk, to
    ``gaps``, from its first token on, but for each turn's first ``SETTLING`` chunks."""
    for answer in answers.values():
        next(answer)  # its prompt
    while answers:
        for name, answer in list(answers.items()):
            last, taken = time.perf_counter(), 0
            for count in itertools.islice(answer, turn):
                now = time.perf_counter()
                if taken >= SETTLING:
                    gaps[name] += [(now - last) / count] * count
                last, taken = now, taken + 1
            if taken < turn:
                del answers[name]


def rates(runs: dict[str, list], interleaved: bool) -> dict[str, float]:
    """Each system's tokens a second: of whole answers, the median over the rounds after the warm-up; or at the
    median gap between tokens (``interleaved``)."""
    if interleaved:
        return {n: 1 / statistics.median(gaps) for n, gaps in runs.items()}
    return {n: statistics.median(len(t) / t[-1] for t in times[1:]) for n, times in runs.items()}


def timeline(name: str, times: list[float]) -> str:
    gaps = sorted(b - a for a, b in zip(times, times[1:]))
    median = statistics.median(gaps)
    lost = sum(g - median for g in gaps if g > 1.5 * median)
    return (f"{name}: first token {1000 * times[0]:.1f} ms, then median {1000 * median:.2f} ms, 90th percentile "
            f"{1000 * gaps[int(0.9 * len(gaps))]:.2f}, largest {1000 * gaps[-1]:.2f}, lost to gaps over 1.5x the "
            f"median {1000 * lost:.1f} ms of {1000 * times[-1]:.1f}")


def registered_kernel(name: str, **options) -> str:
    """``name``, registered as a plugin would register it: the CUDA kernel built with ``options``."""

    class Kernel:
        @hookimpl
        def register_attention_kernels(self, register):
            register(name, lambda: CudaKernel(**options))

    plugins.get_plugin_manager().register(Kernel())
    return name


def read_first(engine: Engine) -> Engine:
    """``engine``, its decode steps built ahead launched only after the step in flight is read."""
    engine.runner.__class__ = type("ReadFirstRunner", (type(engine.runner),), {"writes_in_place": False})
    return engine


def rope_apart(model) -> None:
    """The model's RoPE modules as they were before ``defer_rope``: its layers rotate their queries and keys."""
    for _, module in model.named_modules():
        if isinstance(module.get("rope"), DeferredRoPE):
            module.rope = module.rope.rope


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    parser.add_argument("--bits", nargs="+", choices=["none", "4"], default=["none", "4"])
    parser.add_argument("--smollm2", action="store_true", help="the real SmolLM2-135M instead (the CPU)")
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--timeline", action="store_true", help="where each system's time went in its last round")
    second = parser.add_mutually_exclusive_group()
    second.add_argument("--kernel-warps", type=int, metavar="N", help="also an engine whose kernel keeps N simd groups")
    second.add_argument("--rope-apart", action="store_true", help="also an engine whose model rotates with its RoPE")
    second.add_argument("--kernel-template", metavar="FILE", help="also an engine whose kernel comes from FILE")
    second.add_argument("--read-first", action="store_true", help="also an engine that reads a step, then launches")
    parser.add_argument("--interleave", type=int, metavar="N",
                        help="the systems take turns every N tokens of a round; rates from the median gap")
    args = parser.parse_args()
    if args.interleave is not None and args.interleave <= SETTLING:
        parser.error(f"--interleave takes more than {SETTLING} tokens a turn")
    held = f"engine, {args.kernel_warps} simd groups" if args.kernel_warps else None
    held = "engine, RoPE apart" if args.rope_apart else held
    held = "engine, read first" if args.read_first else held
    held = f"engine, {Path(args.kernel_template).stem}" if args.kernel_template else held
    kernel = None  # the second engine's attention kernel, where it has one of its own
    if args.kernel_warps:
        kernel = registered_kernel(f"cuda ({held})", warps=args.kernel_warps)
    elif args.kernel_template:
        kernel = registered_kernel(f"cuda ({held})", template=Path(args.kernel_template).read_text())
    if args.interleave:
        measure = f"tokens a second at the median gap, the systems taking turns every {args.interleave} tokens"
    else:
        measure = f"tok/s medians of {args.rounds}"
    print(f"# {time.strftime('%Y-%m-%d')}, mlx {mx.__version__} on {mx.default_device()}, a new prompt of 64-128 "
          f"tokens a round, {args.new_tokens} new tokens, {args.rounds} rounds, {measure}")
    extra = f" {held} | its ratio |" if held else ""
    print("| model | weights | mlx-lm generate_step | engine | engine / mlx-lm |" + extra)
    print("|---|---|---:|---:|---:|" + "---:|---:|" * bool(held))
    lines = []
    for name in ["smollm2"] if args.smollm2 else args.models:
        for bits in args.bits:
            model, vocab = load(name, bits)
            baseline, _ = load(name, bits)  # mlx-lm's own: an engine on a GPU merges its model's projections
            prompts = prompts_for(args.rounds + 1, vocab, 1, 64, 128)  # a new one each round: no prefix cache hit
            engines = {"engine": Engine(model, kv_budget_bytes=4 * 2**30)}
            if kernel:
                engines[held] = Engine(model, kv_budget_bytes=4 * 2**30, attention_kernel=kernel)
            elif args.rope_apart:
                engines[held] = Engine(load(name, bits)[0], kv_budget_bytes=4 * 2**30)
                rope_apart(engines[held].model)
            elif args.read_first:
                engines[held] = read_first(Engine(load(name, bits)[0], kv_budget_bytes=4 * 2**30))
            runs = {"mlx-lm": [], **{n: [] for n in engines}}
            for round in range(args.rounds + 1):  # the first is a warm-up
                answers = {"mlx-lm": mlx_lm_tokens(baseline, prompts[round], args.new_tokens)}
                answers.update((n, engine_tokens(e, prompts[round], args.new_tokens)) for n, e in engines.items())
                if args.interleave:
                    interleaved_gaps(answers, args.interleave, runs if round else {n: [] for n in runs})
                else:
                    for n, answer in answers.items():
                        runs[n].append(token_times(answer))
            weights = f"{bits}-bit" if bits != "none" else ("float32" if args.smollm2 else "bf16")
            if args.timeline and not args.interleave:
                lines += [f"{name} {weights}, " + timeline(n, t[-1]) for n, t in runs.items()]
            rate = rates(runs, bool(args.interleave))
            cells = [f"{rate[n]:.1f} | {rate[n] / rate['mlx-lm']:.2f}x" for n in engines]
            print(f"| {name} | {weights} | {rate['mlx-lm']:.1f} | " + " | ".join(cells) + " |", flush=True)
            del model, baseline, engines
    print("\n".join(lines))


if __name__ == "__main__":
    main()
