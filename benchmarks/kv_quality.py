"""Quantized K/V: what it costs in quality and what it buys in context, this engine vs mlx-lm.

Usage (OpenBLAS preloaded, see README):
    python benchmarks/kv_quality.py [--model PATH] [--tokens 2048] [--chunk 256] [--as-rows] [--budget-mib 64]
        [--new-tokens 48] [--skip-quality] [--skip-agreement] [--skip-capacity]

Quality: a fixed text (the description of the installed mlx-lm package, its README) is fed
teacher-forced in chunks, so each position's logits come from K/V the earlier chunks left in
the cache (quantized or not). For every position the script takes KL(P_full || P_quant) of the
next-token distributions, where P_full comes from the same system at full precision: this
engine's paged pools (one sequence, hand-built attention plans, the portable kernel) against
themselves unquantized, and mlx-lm's ``QuantizedKVCache`` against its ``KVCache``.

Agreement: what a user sees. A few chat prompts are answered greedily (EOS ignored) with quantized
K/V and at full precision, by this engine and by mlx-lm's ``generate_step`` (``kv_bits``,
``quantized_kv_start=0``: mlx-lm's own quantized cache from its first prompt chunk on); the table gives,
per system and bits, the mean index of the first generated token that differs from the same system's
full-precision answer (the number of tokens when none does).

Capacity: how many tokens of one sequence's K/V fit in a byte budget, for mlx-lm's
``QuantizedKVCache`` (its buffers grow in steps of 256 tokens; measured by feeding it) and for
this engine's pool (as the engine sizes it from ``kv_budget_bytes``).
"""

import argparse
import importlib.metadata
import os
import platform
import sys
import time
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import KVCache, QuantizedKVCache

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from llm_paged_mlx import Engine, SamplingParams  # noqa: E402
from llm_paged_mlx.kernels import AttentionPlan, PrefillChunk, select_kernel  # noqa: E402
from llm_paged_mlx.models.adapt import check_model  # noqa: E402
from llm_paged_mlx.models.loading import load_model  # noqa: E402
from llm_paged_mlx.models.paged_cache import LayerLayout, PagedLayerCache  # noqa: E402

GROUP_SIZE = 64
BITS = (8, 4)
TEXT_PACKAGE = "mlx-lm"


def text_tokens(tokenizer, count: int) -> tuple[list[int], str]:
    """The first ``count`` tokens of the installed mlx-lm's package description, and where they came from."""
    meta = importlib.metadata.metadata(TEXT_PACKAGE)
    text = meta.get_payload() or meta.get("Description") or ""
    tokens = tokenizer.encode(text)
    if len(tokens) < count:
        raise ValueError(f"the {TEXT_PACKAGE} description has {len(tokens)} tokens, fewer than {count}")
    source = f"the first {count} of {len(tokens)} tokens of the {TEXT_PACKAGE} {meta['Version']} package description"
    return tokens[:count], source


class PagedSequence:
    """One sequence over this engine's paged K/V pools, fed chunk by chunk through hand-built plans.

    A chunk goes to the kernel as one prefill chunk, or with ``as_rows`` as single-query rows
    (the decode path, as the engine's compiled steps serve every row).
    """

    def __init__(self, model, layouts, max_tokens: int, kernel, kv_bits=None, block_size: int = 16, as_rows=False):
        num_blocks = -(-max_tokens // block_size) + 1  # block 0 is the null block
        quant = {} if kv_bits is None else {"kv_bits": kv_bits, "kv_group_size": GROUP_SIZE}
        self.caches = [
            PagedLayerCache(num_blocks, block_size, l.num_kv_heads, l.k_dim, l.v_dim, l.dtype, kernel, **quant)
            for l in layouts
        ]
        self.model, self.block_size, self.as_rows, self.length = model, block_size, as_rows, 0
        self.table = mx.arange(1, num_blocks, dtype=mx.int32)  # position p lives in block p // block_size + 1

    def plan(self, start: int, n: int) -> AttentionPlan:
        end = start + n
        positions = mx.arange(start, end, dtype=mx.int32)
        table = self.table[: -(-end // self.block_size)]
        if self.as_rows:
            tables, lens, chunks = mx.broadcast_to(table[None], (n, table.shape[0])), positions + 1, []
        else:
            tables, lens = mx.zeros((0, 0), dtype=mx.int32), mx.zeros((0,), dtype=mx.int32)
            chunks = [PrefillChunk(0, n, end, table)]
        return AttentionPlan(
            block_size=self.block_size,
            positions=positions,
            slots=positions + self.block_size,
            num_decode=n if self.as_rows else 0,
            decode_block_tables=tables,
            decode_context_lens=lens,
            prefills=chunks,
        )

    def __call__(self, tokens: mx.array) -> mx.array:
        """Logits ``(n, vocab)`` of every one of the ``n`` tokens, appended after those fed before."""
        plan = self.plan(self.length, tokens.shape[0])
        for cache in self.caches:
            cache.plan = plan
        logits = self.model(tokens[:, None], cache=self.caches)[:, 0]
        mx.eval(logits)  # every layer's attention reads its pool after the write, so this runs the writes too
        for cache in self.caches:
            cache.plan = None
        self.length += tokens.shape[0]
        return logits


class MlxLmSequence:
    """One sequence over mlx-lm's own caches: ``KVCache``, or ``QuantizedKVCache`` of ``bits``."""

    def __init__(self, model, kv_bits=None):
        layers = len(model.layers)
        self.caches = [KVCache() if kv_bits is None else QuantizedKVCache(GROUP_SIZE, kv_bits) for _ in range(layers)]
        self.model = model

    def __call__(self, tokens: mx.array) -> mx.array:
        logits = self.model(tokens[None], cache=self.caches)[0]
        mx.eval(logits)
        return logits


def kl_and_agreement(reference: mx.array, other: mx.array) -> tuple[np.ndarray, np.ndarray]:
    """Per row: KL(softmax(reference) || softmax(other)) in nats, and whether the argmaxes agree."""
    ref = reference.astype(mx.float32)
    ref = ref - mx.logsumexp(ref, axis=-1, keepdims=True)
    out = other.astype(mx.float32)
    out = out - mx.logsumexp(out, axis=-1, keepdims=True)
    kl = mx.sum(mx.exp(ref) * (ref - out), axis=-1)
    agree = mx.argmax(ref, axis=-1) == mx.argmax(out, axis=-1)
    return np.array(kl), np.array(agree)


def measure_quality(model, tokens: list[int], chunk: int, bits=BITS, as_rows=False) -> dict:
    """KL and top-1 agreement of each quantized setting against the same system at full precision.

    ``bits`` are run on this engine's pools and on mlx-lm's caches. Returns ``{("engine" | "mlx-lm", bits): {"kl": per-position array,
    "agree": ...}}`` and, under ``"full_max_abs_diff"``, the largest difference between the two
    systems' full-precision logits. ``as_rows`` sends the engine's chunks to the kernel as rows.
    """
    layouts = kv_layouts(model)  # installs the attention hook: paged caches go to the paged kernel
    kernel = select_kernel("portable")
    runs = {("engine", b): PagedSequence(model, layouts, len(tokens), kernel, b, as_rows=as_rows) for b in (None, *bits)}
    runs.update({("mlx-lm", b): MlxLmSequence(model, b) for b in (None, *bits)})
    per = {key: {"kl": [], "agree": []} for key in runs if key[1] is not None}
    diff = 0.0
    for start in range(0, len(tokens), chunk):
        ids = mx.array(tokens[start : start + chunk], dtype=mx.int32)
        logits = {key: run(ids) for key, run in runs.items()}
        diff = max(diff, mx.max(mx.abs(logits["engine", None] - logits["mlx-lm", None])).item())
        for name, b in per:
            kl, agree = kl_and_agreement(logits[name, None], logits[name, b])
            per[name, b]["kl"].append(kl)
            per[name, b]["agree"].append(agree)
    result = {key: {k: np.concatenate(v) for k, v in value.items()} for key, value in per.items()}
    result["full_max_abs_diff"] = diff
    return result


# -- greedy agreement with full precision -------------------------------------------------------------

CHAT_QUESTIONS = (
    "What is the capital of France?", "Explain photosynthesis in one paragraph.", "Write a haiku about the sea.",
    "Give me three tips for learning to play the guitar.", "Name three planets and one fact about each.",
    "How do I boil an egg?", "What is a prime number? Give examples.", "Write a short poem about autumn leaves.",
    "Why is the sky blue?", "Translate 'good morning' into Spanish and French.",
    "What are the benefits of regular exercise?", "Describe how a bicycle works.", "What is the capital of Japan?",
    "Tell me a joke about computers.", "How many legs does a spider have?", "What does a doctor do?",
    "Explain gravity to a child.", "Write two sentences about the moon.", "What is the largest ocean on Earth?",
    "Suggest a name for a cat.", "How do plants drink water?", "What is 12 times 7?", "Why do we need sleep?",
    "Describe the color red without naming it.",
)
BATCH = 4  # prompts the engine answers together


def chat_prompts(tokenizer, questions=CHAT_QUESTIONS) -> list[list[int]]:
    """Each question as one user turn through the model's chat template, ready for an answer."""
    turns = ([{"role": "user", "content": q}] for q in questions)
    return [tokenizer.apply_chat_template(turn, add_generation_prompt=True) for turn in turns]


def first_difference(tokens: list[int], reference: list[int]) -> int:
    """The index of the first token that differs from ``reference``; the length if none does."""
    return next((i for i, (a, b) in enumerate(zip(tokens, reference)) if a != b), min(len(tokens), len(reference)))


def mlx_lm_answers(model, prompts, new_tokens: int, kv_bits=None) -> list[list[int]]:
    """mlx-lm's greedy answers through ``generate_step``, quantizing its cache from the start with ``kv_bits``."""
    quant = {} if kv_bits is None else {"kv_bits": kv_bits, "kv_group_size": GROUP_SIZE, "quantized_kv_start": 0}
    greedy = lambda logprobs: mx.argmax(logprobs, axis=-1)  # noqa: E731
    answers = []
    for prompt in prompts:
        steps = generate_step(mx.array(prompt), model, max_tokens=new_tokens, sampler=greedy, **quant)
        answers.append([int(token) for token, _ in steps])
    return answers


def engine_answers(model, tokenizer, prompts, new_tokens: int, kv_bits=None, **options) -> list[list[int]]:
    """This engine's greedy answers, ``BATCH`` prompts at a time, K/V stored in ``kv_bits``."""
    quant = {} if kv_bits is None else {"kv_bits": kv_bits, "kv_group_size": GROUP_SIZE}
    engine = Engine(model, tokenizer, kv_budget_bytes=256 << 20, verify_model=False, **quant, **options)
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    batches = [prompts[i : i + BATCH] for i in range(0, len(prompts), BATCH)]
    return [out.token_ids for batch in batches for out in engine.generate(batch, params)]


def measure_agreement(model, tokenizer, new_tokens: int = 48, bits=BITS, prompts=None, **options) -> dict:
    """Per system (``"engine"``, ``"mlx-lm"``) and bits: each prompt's first-difference index from that
    system's full-precision answer; ``("engine", None)``: the engine's full-precision answers' first
    differences from mlx-lm's (the length when they are equal)."""
    prompts = chat_prompts(tokenizer) if prompts is None else prompts
    full = {
        "mlx-lm": mlx_lm_answers(model, prompts, new_tokens),
        "engine": engine_answers(model, tokenizer, prompts, new_tokens, **options),
    }
    result = {("engine", None): [first_difference(a, b) for a, b in zip(full["engine"], full["mlx-lm"])]}
    for b in bits:
        quantized = {
            "mlx-lm": mlx_lm_answers(model, prompts, new_tokens, b),
            "engine": engine_answers(model, tokenizer, prompts, new_tokens, b, **options),
        }
        for name, answers in quantized.items():
            result[name, b] = [first_difference(a, r) for a, r in zip(answers, full[name])]
    return result


def agreement_table(model, tokenizer, new_tokens: int):
    print(f"\n## Greedy agreement with full precision ({len(CHAT_QUESTIONS)} chat prompts, {new_tokens} tokens, "
          f"group size {GROUP_SIZE})\n")
    start = time.perf_counter()
    result = measure_agreement(model, tokenizer, new_tokens)
    print(f"({time.perf_counter() - start:.1f} s)\n")
    same = result["engine", None]
    print(f"Full precision, engine vs mlx-lm: first difference at {same} (of {new_tokens}: none)\n")
    print(f"| K/V | first differing token, per prompt | mean | mean of the first 4 | none differs | engine / mlx-lm |")
    print("|---|---|---:|---:|---:|---:|")
    for b in BITS:
        for name in ("engine", "mlx-lm"):
            firsts = result[name, b]
            ratio = f"{np.mean(firsts) / max(np.mean(result['mlx-lm', b]), 1e-9):.2f}x" if name == "engine" else ""
            label = "this engine" if name == "engine" else "mlx-lm QuantizedKVCache"
            whole = sum(f == new_tokens for f in firsts)
            print(f"| {label}, {b}-bit | {', '.join(map(str, firsts))} | {np.mean(firsts):.1f} | "
                  f"{np.mean(firsts[:4]):.1f} | {whole} of {len(firsts)} | {ratio} |")


# -- capacity in a byte budget -----------------------------------------------------------------


def mlx_lm_capacity(layouts, budget: int, bits) -> dict:
    """The longest sequence whose ``QuantizedKVCache``s (``KVCache``s for ``bits=None``) fit in ``budget`` bytes.

    Measured: the caches are fed zeros 256 tokens at a time (the step they grow by, and how a
    prefill in chunks of 256 or 2048 feeds them) until their ``nbytes`` pass the budget; one
    more token after the last length that fits must not fit either.
    """
    caches = [KVCache() if bits is None else QuantizedKVCache(GROUP_SIZE, bits) for _ in layouts]

    def feed(n):
        for cache, layout in zip(caches, layouts):
            shape = (1, layout.num_kv_heads, n)
            cache.update_and_fetch(mx.zeros((*shape, layout.k_dim), layout.dtype), mx.zeros((*shape, layout.v_dim), layout.dtype))
        mx.eval([c.state[:2] for c in caches])
        return sum(c.nbytes for c in caches)

    step = KVCache.step if bits is None else QuantizedKVCache.step
    fits, fitting_bytes = 0, 0
    while (nbytes := feed(step)) <= budget:
        fits, fitting_bytes = fits + step, nbytes
    # The caches now hold a buffer too big: start again at the last length that fit, then add one token.
    caches = [KVCache() if bits is None else QuantizedKVCache(GROUP_SIZE, bits) for _ in layouts]
    if fits:
        assert feed(fits) == fitting_bytes
    assert feed(1) > budget, "one token more than the measured capacity still fits"
    return {"tokens": fits, "bytes": fitting_bytes}


def engine_capacity(model, budget: int, bits) -> dict:
    """The tokens this engine's pool holds when sized from ``kv_budget_bytes=budget`` (null block excluded)."""
    quant = {} if bits is None else {"kv_bits": bits, "kv_group_size": GROUP_SIZE}
    engine = Engine(model, kv_budget_bytes=budget, attention_kernel="portable", verify_model=False, **quant)
    stats = engine.stats()
    total = (stats["num_blocks"] + 1) * stats["block_size"]
    return {
        "tokens": stats["num_blocks"] * stats["block_size"],
        "bytes": stats["kv_cache_bytes"],
        "bytes_per_token": stats["kv_cache_bytes"] / total,
    }


# -- the report ------------------------------------------------------------------------------------


def print_header(model_path: str):
    versions = ", ".join(f"{p} {importlib.metadata.version(p)}" for p in ("mlx", "mlx-lm", "llm-paged-mlx"))
    machine = f"{platform.machine()}, {platform.system()}, {os.cpu_count()} CPUs"
    print(f"# {time.strftime('%Y-%m-%d %H:%M')}, {machine}, Python {platform.python_version()}")
    print(f"# {versions}; device {mx.default_device()}; model {Path(model_path).name} (dequantized to float32)")


def quality_table(model, tokenizer, num_tokens: int, chunk: int, as_rows=False):
    tokens, source = text_tokens(tokenizer, num_tokens)
    print(f"\n## K/V quantization quality (group size {GROUP_SIZE}, teacher-forced in chunks of {chunk})\n")
    path = "single-query rows (the decode path)" if as_rows else "prefill chunks"
    print(f"Text: {source}. The engine's chunks reach its kernel as {path}.")
    bits = BITS
    start = time.perf_counter()
    result = measure_quality(model, tokens, chunk, bits, as_rows=as_rows)
    print(f"({time.perf_counter() - start:.1f} s)\n")
    print(f"Full precision, engine vs mlx-lm KVCache: max |logit difference| {result['full_max_abs_diff']:.2e}\n")
    print("| K/V | mean KL (nats) | max KL | top-1 agreement | KL engine / mlx-lm |")
    print("|---|---:|---:|---:|---:|")
    for name in ("engine", "mlx-lm"):
        for b in bits:
            if (name, b) not in result:
                continue
            kl, agree = result[name, b]["kl"], result[name, b]["agree"]
            ratio = ""
            if name == "engine" and ("mlx-lm", b) in result:
                ratio = f"{kl.mean() / result['mlx-lm', b]['kl'].mean():.3f}x"
            label = "this engine" if name == "engine" else "mlx-lm QuantizedKVCache"
            print(f"| {label}, {b}-bit | {kl.mean():.3e} | {kl.max():.3e} | {agree.mean():.2%} | {ratio} |")


def kv_layouts(model) -> list[LayerLayout]:
    spec = check_model(model)
    if spec.states:
        raise SystemExit("kv_quality.py measures models whose every cache holds K/V (no recurrent layers)")
    return spec.attention


def capacity_table(model, budget: int):
    layouts = kv_layouts(model)
    context = getattr(getattr(model, "args", None), "max_position_embeddings", None)
    print(f"\n## One sequence's K/V in a budget of {budget / 2**20:g} MiB (group size {GROUP_SIZE})\n")
    print(
        "| K/V | mlx-lm bytes/token | engine bytes/token | mlx-lm tokens (bytes) | this engine tokens (bytes) "
        "| engine / mlx-lm, same bits | engine / mlx-lm KVCache |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    settings = [None, *BITS]
    baseline = None
    for bits in settings:
        theirs = mlx_lm_capacity(layouts, budget, bits)
        ours = engine_capacity(model, budget, bits)
        baseline = baseline or theirs
        name = "full precision (KVCache)" if bits is None else f"{bits}-bit (QuantizedKVCache)"
        print(
            f"| {name} | {theirs['bytes'] / theirs['tokens']:,.0f} | {ours['bytes_per_token']:,.0f} "
            f"| {theirs['tokens']:,} ({theirs['bytes']:,}) | {ours['tokens']:,} ({ours['bytes']:,}) "
            f"| {ours['tokens'] / theirs['tokens']:.3f}x | {ours['tokens'] / baseline['tokens']:.2f}x |"
        )
    if context:
        print(f"\nThe model's own context is {context:,} tokens; the engine admits min(pool, context) per request.")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="mlx-lm folder (default: the converted SmolLM2)")
    parser.add_argument("--tokens", type=int, default=2048, help="length of the text")
    parser.add_argument("--chunk", type=int, default=256, help="tokens fed per forward pass")
    parser.add_argument("--budget-mib", type=float, default=64, help="K/V budget of the capacity table")
    parser.add_argument("--as-rows", action="store_true", help="send the engine's chunks as single-query rows")
    parser.add_argument("--new-tokens", type=int, default=48, help="tokens of each answer in the agreement table")
    parser.add_argument("--skip-quality", action="store_true")
    parser.add_argument("--skip-agreement", action="store_true")
    parser.add_argument("--skip-capacity", action="store_true")
    args = parser.parse_args()
    if args.model is None:
        from smollm2 import smollm2_dir

        args.model = str(smollm2_dir())
    model, tokenizer = load_model(args.model, dequantize=True, dtype="float32")
    print_header(args.model)
    if not args.skip_quality:
        quality_table(model, tokenizer, args.tokens, args.chunk, args.as_rows)
    if not args.skip_agreement:
        agreement_table(model, tokenizer, args.new_tokens)
    if not args.skip_capacity:
        capacity_table(model, int(args.budget_mib * 2**20))


if __name__ == "__main__":
    main()
