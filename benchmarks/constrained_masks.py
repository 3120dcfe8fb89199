"""Which library makes the token masks of JSON-schema constrained decoding: llguidance or outlines-core.

    PYTHONPATH=. python3 benchmarks/constrained_masks.py [--tokenizer-dir DIR]

For SmolLM2's tokenizer (49,152 tokens; from ``--tokenizer-dir``, default the test cache) and a byte-level BPE tokenizer grown from it to 150,000 tokens (the
size of Qwen's), and the JSON schemas of ``tests/test_schemas.py``: the time to compile a schema into what
makes masks (first use), and the time to make the masks of one decode step for 64 requests, each at its own
point of its own schema (every request advanced by tokens its mask allows, chosen at random, as sampling
would). llguidance makes a step's masks on its thread pool (``LLExecutor``) or one after another;
outlines-core one after another. Median of the steps; xgrammar is left out (it needs PyTorch).
"""

import argparse
import datetime
import importlib.metadata
import importlib.util
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

import llguidance
import llguidance.hf
import llguidance.numpy
import numpy as np
from tokenizers import Tokenizer
from transformers import PreTrainedTokenizerFast

sys.path.insert(0, str(Path(__file__).parents[1] / "tests"))
from json_schemas import SCHEMAS  # noqa: E402

REQUESTS, STEPS, LARGE_VOCAB = 64, 24, 150_000


def grown(tokenizer_json: dict, size: int, seed: int = 0) -> PreTrainedTokenizerFast:
    """The BPE tokenizer with merges of existing tokens added until it has ``size`` tokens."""
    data = json.loads(json.dumps(tokenizer_json))
    vocab, merges = data["model"]["vocab"], data["model"]["merges"]
    tokens = [t for t in vocab if len(t) > 1]
    rng = random.Random(seed)
    while len(vocab) < size - len(data.get("added_tokens", [])):
        a, b = rng.choice(tokens), rng.choice(tokens)
        if a + b not in vocab:
            vocab[a + b] = len(vocab)
            merges.append([a, b] if isinstance(merges[0], list) else f"{a} {b}")
    for i, token in enumerate(data.get("added_tokens", [])):  # added tokens keep ids past the vocabulary
        token["id"] = len(vocab) + i
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(json.dumps(data)), eos_token="<|im_end|>")


def llguidance_case(tokenizer, schemas):
    start = time.perf_counter()
    lltok = llguidance.hf.from_tokenizer(tokenizer)
    tokenizer_s = time.perf_counter() - start
    compile_ms, matchers = [], []
    for i in range(REQUESTS):
        start = time.perf_counter()
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schemas[i % len(schemas)])
        matcher = llguidance.LLMatcher(lltok, grammar)
        compile_ms.append((time.perf_counter() - start) * 1e3)
        assert not matcher.is_error(), matcher.get_error()
        matchers.append(matcher)
    executor = llguidance.LLExecutor()
    mask = llguidance.numpy.allocate_token_bitmask(REQUESTS, lltok.vocab_size)
    parallel, serial, rng = [], [], np.random.default_rng(0)
    for _ in range(STEPS):
        start = time.perf_counter()
        llguidance.numpy.fill_next_token_bitmask_par(executor, [(m, i) for i, m in enumerate(matchers)], mask)
        parallel.append((time.perf_counter() - start) * 1e3)
        start = time.perf_counter()
        for i, m in enumerate(matchers):
            llguidance.numpy.fill_next_token_bitmask(m, mask, i)
        serial.append((time.perf_counter() - start) * 1e3)
        for i, m in enumerate(matchers):
            allowed = np.flatnonzero(np.unpackbits(mask[i].view(np.uint8), bitorder="little")[: lltok.vocab_size])
            if m.is_stopped() or not len(allowed):
                m.reset()
                continue
            m.consume_token(int(rng.choice(allowed)))
    return {"tokenizer_s": tokenizer_s, "compile_ms": statistics.median(compile_ms),
            "step_parallel_ms": statistics.median(parallel), "step_serial_ms": statistics.median(serial)}  # fmt: skip


def outlines_case(tokenizer, schemas, eos: int):
    import outlines_core
    from outlines_core import Guide, Index, Vocabulary

    start = time.perf_counter()
    decoder = {v: k for k, v in _bytes_to_unicode().items()}
    entries: dict[bytes, list[int]] = {}
    for token, i in tokenizer.get_vocab().items():
        if i != eos:
            raw = bytes(decoder[c] for c in token) if all(c in decoder for c in token) else token.encode()
            entries.setdefault(raw, []).append(i)
    vocabulary = Vocabulary(eos, entries)
    tokenizer_s = time.perf_counter() - start
    compile_ms, indexes = [], {}
    for schema in schemas:
        start = time.perf_counter()
        regex = outlines_core.json_schema.build_regex_from_schema(schema)
        indexes[schema] = Index(regex, vocabulary)
        compile_ms.append((time.perf_counter() - start) * 1e3)
    guides = [Guide(indexes[schemas[i % len(schemas)]]) for i in range(REQUESTS)]
    words = (len(tokenizer.get_vocab()) + 31) // 32
    mask = np.zeros((REQUESTS, words), dtype=np.int32)
    serial, rng = [], random.Random(0)
    for _ in range(STEPS):
        start = time.perf_counter()
        for i, guide in enumerate(guides):
            guide.write_mask_into(mask[i].ctypes.data, words, 4)
        serial.append((time.perf_counter() - start) * 1e3)
        for guide in guides:
            if guide.is_finished():
                guide.reset()
            else:
                guide.advance(rng.choice(guide.get_tokens()))
    return {"tokenizer_s": tokenizer_s, "compile_ms": statistics.median(compile_ms),
            "step_serial_ms": statistics.median(serial)}  # fmt: skip


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet: each byte's character in a byte-level BPE vocabulary."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokenizer-dir", help="SmolLM2's folder (default: the test cache)")
    args = parser.parse_args()
    if args.tokenizer_dir is None:
        from smollm2 import smollm2_dir

        args.tokenizer_dir = smollm2_dir()
    libraries = {"llguidance": llguidance_case, "outlines-core": outlines_case}
    if importlib.util.find_spec("outlines_core") is None:
        del libraries["outlines-core"]
    versions = {name: importlib.metadata.version(name) for name in libraries}
    print(f"# {datetime.date.today()}, {versions}, {os.cpu_count()} CPUs, {REQUESTS} requests")
    source = Path(args.tokenizer_dir) / "tokenizer.json"
    tokenizers = {
        "SmolLM2 (49,152)": PreTrainedTokenizerFast(tokenizer_file=str(source), eos_token="<|im_end|>"),
        f"grown ({LARGE_VOCAB:,})": grown(json.loads(source.read_text()), LARGE_VOCAB),
    }
    schemas = [json.dumps(s) for s in SCHEMAS]
    print("| vocabulary | library | tokenizer setup s | compile a schema ms | masks of a step, parallel ms | "
          "masks of a step, one by one ms |")
    print("|---|---|---:|---:|---:|---:|")
    for name, tokenizer in tokenizers.items():
        eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
        for library, case in libraries.items():
            row = case(tokenizer, schemas) if library == "llguidance" else case(tokenizer, schemas, eos)
            parallel = f"{row['step_parallel_ms']:.2f}" if "step_parallel_ms" in row else "-"
            print(f"| {name} | {library} | {row['tokenizer_s']:.2f} | {row['compile_ms']:.1f} | {parallel} | "
                  f"{row['step_serial_ms']:.2f} |", flush=True)


if __name__ == "__main__":
    main()
