"""What JSON-schema constrained decoding costs the engine: every request constrained against none, one process.

    PYTHONPATH=. python3 benchmarks/constrained_throughput.py [--random qwen3-0.6b | qwen3-8b]
                                                              [--concurrency 16 64] [--new-tokens 64]

The model is SmolLM2-135M (the default, for the CPU) or a random-weight Qwen3-0.6B- or Qwen3-8B-shaped one (for
a GPU) with SmolLM2's tokenizer (its vocabulary, 49,152). Each request asks for a list of people (an array of
objects with a bounded name, an integer age and an enum), at least 100 of them, so the grammar keeps every
request going for exactly ``--new-tokens`` tokens; the free requests ignore EOS, so both generate the same
number of tokens and only time differs. The two are run in alternation after a warm-up, ``--rounds``
times; medians are reported, and the time llguidance takes to make one step's masks (median and mean over the
steps; the engine makes them on another thread while it launches the step's forward pass).
"""

import argparse
import datetime
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx
from mlx_lm.models import qwen3
from mlx_lm.tokenizer_utils import load as load_tokenizer

from llm_paged_mlx import Engine, SamplingParams
from llm_paged_mlx.models.loading import load_model

sys.path.insert(0, str(Path(__file__).parents[1] / "tests"))

PEOPLE = {
    "type": "array",
    "minItems": 100,
    "items": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 24},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "role": {"enum": ["engineer", "artist", "doctor", "teacher"]},
        },
        "required": ["name", "age", "role"],
    },
}
QWEN3 = dict(
    model_type="qwen3", head_dim=128, vocab_size=49152, rope_theta=1_000_000.0, max_position_embeddings=40960,
    rms_norm_eps=1e-6,
)  # fmt: skip
SHAPES = {
    "qwen3-0.6b": dict(QWEN3, hidden_size=1024, num_hidden_layers=28, intermediate_size=3072, num_attention_heads=16,
                       num_key_value_heads=8, tie_word_embeddings=True),
    "qwen3-8b": dict(QWEN3, hidden_size=4096, num_hidden_layers=36, intermediate_size=12288, num_attention_heads=32,
                     num_key_value_heads=8, tie_word_embeddings=False),
}  # fmt: skip


def load(args):
    from smollm2 import smollm2_dir

    folder = Path(args.tokenizer_dir) if args.tokenizer_dir else smollm2_dir()
    if args.random is None:
        return load_model(str(folder))
    model = qwen3.Model(qwen3.ModelArgs.from_dict(SHAPES[args.random]))
    model.set_dtype(mx.bfloat16)
    mx.eval(model.parameters())
    return model, load_tokenizer(folder)


def timed(owner, name: str) -> list[float]:
    """Wrap ``owner.name`` to note each call's milliseconds in the list returned."""
    function, times = getattr(owner, name), []

    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        result = function(*args, **kwargs)
        times.append((time.perf_counter() - start) * 1e3)
        return result

    setattr(owner, name, wrapper)
    return times


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--random", choices=list(SHAPES), help="a random-weight model of this shape")
    parser.add_argument("--tokenizer-dir", help="SmolLM2's folder (default: the test cache)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    model, tokenizer = load(args)
    engine = Engine(model, tokenizer, kv_budget_bytes=2 << 30)
    mask_ms = timed(engine.grammars, "bitmask")
    name = args.random or "SmolLM2-135M"
    print(f"# {datetime.date.today()}, mlx {mx.__version__} on {mx.default_device()}, {name}, "
          f"{args.new_tokens} new tokens per request")  # fmt: skip
    print("| requests | free tok/s | constrained tok/s | constrained / free | masks of a step ms, median / mean |")
    print("|---:|---:|---:|---:|---:|")
    for n in args.concurrency:
        questions = [[{"role": "user", "content": f"List people, {i}."}] for i in range(n)]
        prompts = [tokenizer.apply_chat_template(q, add_generation_prompt=True) for q in questions]
        kinds = {
            "free": SamplingParams(max_tokens=args.new_tokens, ignore_eos=True),
            "constrained": SamplingParams(max_tokens=args.new_tokens, json_schema=PEOPLE),
        }
        rates = {kind: [] for kind in kinds}
        mask_ms.clear()
        for round_ in range(args.rounds + 1):
            for kind, params in kinds.items():
                start = time.perf_counter()
                outputs = engine.generate(prompts, [params] * n)
                elapsed = time.perf_counter() - start
                generated = sum(len(o.token_ids) for o in outputs)
                assert generated == n * args.new_tokens, (kind, generated)
                if round_:  # the first round warms up
                    rates[kind].append(generated / elapsed)
        free, constrained = (statistics.median(rates[k]) for k in kinds)
        masks = f"{statistics.median(mask_ms):.2f} / {statistics.mean(mask_ms):.2f}"
        print(f"| {n} | {free:.1f} | {constrained:.1f} | {constrained / free:.2f}x | {masks} |", flush=True)


if __name__ == "__main__":
    main()
