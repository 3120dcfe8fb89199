"""Time to first token of a follow-up chat turn, after 512, 2K and ~8K tokens of history.

Three ways to serve the follow-up (prompt = first turn + its answer + a new question):
  re-prefill  a fresh engine with prefix caching off computes the whole prompt (what llm-mlx does);
  in-process  the engine that served the first turn reuses its cached blocks;
  from disk   a new process loads the model and an engine over the disk tier the first turn filled
              (a copy of it, taken before the in-process run), and reads the blocks back.
The new process's start, imports and model load are reported apart from its TTFT.

Usage (OpenBLAS preloaded, see README):
    python benchmarks/conversation_ttft.py [--model PATH] [--history 512 2048 8000]
"""

import time

STARTED = time.time()  # before the heavy imports: a child process reports its start-up from here

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import platform  # noqa: E402
import random  # noqa: E402
import shutil  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402

import mlx.core as mx  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from llm_paged_mlx import Engine, SamplingParams  # noqa: E402
from llm_paged_mlx.engine.disk.store import KVDiskCache  # noqa: E402
from llm_paged_mlx.models.identity import model_identity  # noqa: E402
from llm_paged_mlx.models.loading import load_model  # noqa: E402

IMPORTED = time.time()
KV_BUDGET = 1024**3
ANSWER_TOKENS = 32
FOLLOW_UP_TOKENS = 8  # EOS ignored, so that every way gives (and compares) as many tokens
DIGESTS = "weight-digests.json"  # where model_identity keeps the weight files' digests
WORDS = (
    "harbor lantern keeper river stone window garden winter morning letter candle bridge forest engine "
    "copper valley signal market orchard thunder journey station compass meadow island ribbon mirror "
    "quiet golden distant gentle narrow ancient hidden bright silver patient careful sudden steady"
).split()
QUESTION = "Thanks. Now list the three words from my notes that you find most interesting, and say why."


def first_turn_messages(tokenizer, history_tokens: int) -> list[dict]:
    """A user turn whose prompt, with a short answer, makes about ``history_tokens`` tokens."""
    rng = random.Random(history_tokens)
    words = [rng.choice(WORDS) for _ in range(history_tokens)]

    def messages(n):
        text = "Here are my notes: " + " ".join(words[:n]) + ". Summarize them in one sentence."
        return [{"role": "user", "content": text}]

    low, high = 1, len(words)
    while low < high:  # the most words whose prompt leaves room for the answer
        mid = (low + high + 1) // 2
        prompt = tokenizer.apply_chat_template(messages(mid), add_generation_prompt=True)
        fits = len(prompt) <= history_tokens - ANSWER_TOKENS
        low, high = (mid, high) if fits else (low, mid - 1)
    return messages(low)


def time_to_first_token(engine, prompt):
    """(seconds to the first token, the tokens, prompt tokens served from the cache, of those from disk)."""
    start = time.perf_counter()
    first, tokens, cached, from_disk = None, [], 0, 0
    for chunk in engine.stream(prompt, SamplingParams(max_tokens=FOLLOW_UP_TOKENS, ignore_eos=True)):
        if chunk.token_ids and first is None:
            first = time.perf_counter()
        tokens += chunk.token_ids
        if chunk.finish_reason:
            cached, from_disk = chunk.num_cached_tokens, chunk.num_disk_cached_tokens
    return first - start, tokens, cached, from_disk


def child(args):
    """The new process: load the model and an engine over the disk tier, time the follow-up."""
    model, tokenizer = load_model(args.model, dequantize=True, dtype="float32")
    mx.eval(model.parameters())  # mlx loads (and dequantizes) lazily: count it in the load, not the TTFT
    loaded = time.time()
    digests = Path(args.disk).parent / DIGESTS  # as a later llm process finds them
    cache = KVDiskCache(args.disk, model_identity(args.model, digests, dtype="float32"))
    engine = Engine(model, tokenizer, kv_budget_bytes=KV_BUDGET, kv_disk_cache=cache)
    ready = time.time()
    ttft, tokens, cached, from_disk = time_to_first_token(engine, json.loads(Path(args.prompt).read_text()))
    timings = {"started": STARTED, "imported": IMPORTED, "loaded": loaded, "ready": ready}
    print(json.dumps({**timings, "ttft": ttft, "tokens": tokens, "cached": cached, "from_disk": from_disk}))


def from_disk_in_new_process(args, disk: Path, prompt: list[int]) -> dict:
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as file:
        json.dump(prompt, file)
    spawned = time.time()
    command = [sys.executable, __file__, "--child", "--model", args.model, "--disk", str(disk), "--prompt", file.name]
    run = subprocess.run(command, capture_output=True, text=True, check=True)
    os.unlink(file.name)
    result = json.loads(run.stdout.strip().splitlines()[-1])
    result["start"] = result["imported"] - spawned
    result["load"] = result["loaded"] - result["imported"]
    result["setup"] = result["ready"] - result["loaded"]
    return result


def one_history(args, model, tokenizer, model_id, history_tokens, workdir: Path) -> dict:
    disk = workdir / f"kv-{history_tokens}"
    engine = Engine(model, tokenizer, kv_budget_bytes=KV_BUDGET, kv_disk_cache=KVDiskCache(disk, model_id))
    messages = first_turn_messages(tokenizer, history_tokens)
    answer = engine.generate(
        [tokenizer.apply_chat_template(messages, add_generation_prompt=True)], SamplingParams(max_tokens=ANSWER_TOKENS)
    )[0]
    engine.disk.flush()
    snapshot = workdir / f"kv-{history_tokens}-child"
    shutil.copytree(disk, snapshot)  # what the first turn left on disk, untouched by the runs below

    messages += [{"role": "assistant", "content": answer.text}]
    history = len(tokenizer.apply_chat_template(messages))
    messages += [{"role": "user", "content": QUESTION}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True)

    fresh = Engine(model, tokenizer, kv_budget_bytes=KV_BUDGET, enable_prefix_caching=False)
    full, full_tokens, _, _ = time_to_first_token(fresh, prompt)
    del fresh
    reuse, reuse_tokens, reused, _ = time_to_first_token(engine, prompt)
    del engine
    mx.clear_cache()
    disk_run = from_disk_in_new_process(args, snapshot, prompt)
    return {
        "history": history,
        "prompt": len(prompt),
        "full": full,
        "reuse": reuse,
        "reused": reused,
        "disk": disk_run["ttft"],
        "from_disk": disk_run["from_disk"],
        "start": disk_run["start"],
        "load": disk_run["load"],
        "setup": disk_run["setup"],
        "disk_mb": sum(f.stat().st_size for f in snapshot.iterdir()) / 1e6,
        "same": full_tokens == reuse_tokens == disk_run["tokens"],
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="mlx-lm folder (default: the converted SmolLM2)")
    parser.add_argument("--history", type=int, nargs="+", default=[512, 2048, 8000])
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--disk", help=argparse.SUPPRESS)
    parser.add_argument("--prompt", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.model is None:
        from smollm2 import smollm2_dir

        args.model = str(smollm2_dir())
    if args.child:
        return child(args)
    model, tokenizer = load_model(args.model, dequantize=True, dtype="float32")
    print(f"# {platform.machine()}, {os.cpu_count()} cores, mlx {mx.__version__}, device {mx.default_device()}, "
          f"{time.strftime('%Y-%m-%d %H:%M')}, load average {os.getloadavg()[0]:.1f}")
    print(f"# {Path(args.model).name} fp32, {FOLLOW_UP_TOKENS} tokens per follow-up, KV pool {KV_BUDGET >> 20} MiB")
    Engine(model, tokenizer, kv_budget_bytes=64 << 20).generate(["Hello"], SamplingParams(max_tokens=4))  # warm-up
    print("| history | follow-up prompt | re-prefill TTFT | in-process TTFT (reused) | speed-up | from disk TTFT (read) "
          "| speed-up | new process: start+imports / model load / engine | on disk | same tokens |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as workdir:
        model_id = model_identity(args.model, Path(workdir) / DIGESTS, dtype="float32")
        for history_tokens in args.history:
            r = one_history(args, model, tokenizer, model_id, history_tokens, Path(workdir))
            print(
                f"| {r['history']} | {r['prompt']} | {r['full']:.2f} s | {r['reuse']:.3f} s ({r['reused']}) "
                f"| {r['full'] / r['reuse']:.0f}x | {r['disk']:.3f} s ({r['from_disk']}) "
                f"| {r['full'] / r['disk']:.0f}x | {r['start']:.1f} s / {r['load']:.1f} s / {r['setup']:.1f} s "
                f"| {r['disk_mb']:.0f} MB | {r['same']} |",
                flush=True,
            )
    print(f"# load average at the end {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
