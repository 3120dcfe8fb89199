"""K/V bytes held for one long sequence of a Gemma-3-shaped model: the engine against mlx-lm's caches.

    PYTHONPATH=. python3 benchmarks/window_memory.py [--tokens 3072] [--layers 12]

The model has Gemma 3 27B's attention layers (a 1024-token window on 5 of every 6, 16 KV heads of
128), fewer of them (62 in the 27B model) and small other sizes, so a long sequence runs on a CPU in
minutes; float32 (bf16 is slow on the CPU), so every figure is twice what bf16 holds, and the ratios
are the same. One prompt of ``--tokens``
tokens, then 16 new tokens. Measured: the bytes of the blocks the engine holds for it (block tables per group
of layers: the windowed groups return blocks their window has passed), the same engine with one table for
all layers (what it did before), and mlx-lm's own caches (``RotatingKVCache`` for the windowed layers,
``KVCache`` for the others) after the same tokens.
"""

import argparse
import datetime

import mlx.core as mx
import mlx_lm
from mlx_lm.generate import generate_step
from mlx_lm.models import gemma3_text

from llm_paged_mlx import Engine, SamplingParams
from llm_paged_mlx.engine import runner as runner_module
from llm_paged_mlx.engine.kv_groups import kv_groups

GEMMA3_27B_ATTENTION = dict(
    model_type="gemma3_text", num_hidden_layers=62, sliding_window=1024, sliding_window_pattern=6,
    num_key_value_heads=16, head_dim=128, num_attention_heads=16,
    hidden_size=256, intermediate_size=256, vocab_size=1024,
)  # fmt: skip
BLOCK = 16
NEW_TOKENS = 16


def engine_bytes(model, prompt, grouped: bool) -> int:
    """The bytes of the blocks the engine holds for the sequence just before its last token."""
    saved = runner_module.kv_groups
    if not grouped:  # one table for every layer: what the engine did before it had groups
        runner_module.kv_groups = lambda windows, uniform: kv_groups(windows, uniform=False)
    try:
        engine = Engine(model, block_size=BLOCK, kv_budget_bytes=32 << 30, enable_prefix_caching=False)
    finally:
        runner_module.kv_groups = saved
    request_id = engine.add_request(prompt, SamplingParams(max_tokens=NEW_TOKENS))
    held = 0
    while engine.has_unfinished():
        engine.step()
        if request_id in engine.requests:
            held = engine.stats()["used_blocks"]
    return held * engine.pool.block_bytes


def mlx_lm_bytes(model, prompt) -> int:
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    generated = sum(1 for _ in generate_step(mx.array(prompt), model, max_tokens=NEW_TOKENS, prompt_cache=cache))
    assert generated == NEW_TOKENS
    return sum(c.nbytes for c in cache)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=3072)
    parser.add_argument("--layers", type=int, default=12)
    args = parser.parse_args()
    mx.random.seed(0)
    config = dict(GEMMA3_27B_ATTENTION, num_hidden_layers=args.layers)
    model = gemma3_text.Model(gemma3_text.ModelArgs.from_dict(config))
    prompt = mx.random.randint(0, GEMMA3_27B_ATTENTION["vocab_size"], (args.tokens,)).tolist()
    print(f"# {datetime.date.today()}, mlx {mx.__version__}, mlx-lm {mlx_lm.__version__}, {mx.default_device()}")
    print(f"# {args.layers} of Gemma-3-27B's attention layers, one sequence of {args.tokens} + {NEW_TOKENS} tokens")
    reference = mlx_lm_bytes(model, prompt)
    rows = [
        ("mlx-lm (RotatingKVCache for windowed layers)", reference),
        ("engine, block tables per group", engine_bytes(model, prompt, grouped=True)),
        ("engine, one block table for all layers", engine_bytes(model, prompt, grouped=False)),
    ]
    print("| cache | K/V bytes held | vs mlx-lm |\n|---|---:|---:|")
    for name, nbytes in rows:
        print(f"| {name} | {nbytes:,} | {nbytes / reference:.2f}x |")


if __name__ == "__main__":
    main()
