"""Serving throughput and latency: this project's OpenAI-compatible server vs ``mlx_lm.server``.

Both servers serve the same model folder in the same run, one after the other (never at the same
time, so they never share the machine). For each client count N, N concurrent clients (the
``openai`` async client) each send ``--requests-per-client`` streaming chat completions in sequence,
``max_tokens=--max-tokens``, temperature 0, EOS honoured by both servers. Every request of a run gets
its own question (the same sequence on both servers), so the prefix cache only shares the chat
template's opening. Each server answers one warm-up request before anything is timed.

Per request: TTFT (request sent -> first content chunk), inter-token latencies (between content
chunks) and output tokens (the final usage chunk's ``completion_tokens``; content chunks where a
server sends no usage, flagged in the table). Per (server, N): requests/s and output tokens/s over
the wall time of the N clients, TTFT and ITL p50/p99; then ours / mlx_lm.server ratios.

CPU (OpenBLAS preloaded, see README), SmolLM2-135M-Instruct dequantized to float32 first: on the CPU
our server dequantizes quantized weights at load and mlx_lm.server does not (MLX's CPU 4-bit matmuls
are slow and barely gain from batching), so a quantized folder would measure that, not serving:
    python -m mlx_lm convert --hf-path ~/.cache/llm-paged-mlx/models/SmolLM2-135M-Instruct \\
        --mlx-path /tmp/smollm2-fp32 -d --dtype float32
    python benchmarks/serving.py --model /tmp/smollm2-fp32 --clients 1,4,16 --max-tokens 64
GPU (H200): a random-weight Qwen3-0.6B-shaped bf16 model (but SmolLM2's tokenizer and its 49,152-token
vocabulary), saved to a folder first, then served by both:
    python benchmarks/serving.py --model SMOLLM2_FOLDER --save-random-qwen3 /tmp/qwen3-random \\
        --clients 64,256 --max-tokens 128 --requests-per-client 4 --client-processes 8 \\
        --mlx-lm-decode-concurrency 256 --option kv_budget=40GB
Options: --servers paged,mlx_lm (one or both), --option key=value (repeatable; our server's
``-o key value``), --mlx-lm-decode-concurrency N[,N...] (one mlx_lm.server run per value; ours is
compared with the fastest), --json OUT (also write the results as JSON). A failed request (a reset
connection, a server error) is counted in the table, not fatal.
"""

import argparse
import asyncio
import multiprocessing
import datetime
import importlib.metadata
import json
import os
import platform
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import openai

ASKS = ["In two sentences, explain {}.", "Give three facts about {}.", "Why does {} matter?",
        "Write a haiku about {}.", "What is a common misconception about {}?",
        "How would you teach {} to a child?", "Name one open question about {}."]
TOPICS = ["photosynthesis", "black holes", "the Roman Empire", "compound interest", "volcanoes",
          "the immune system", "jazz", "prime numbers", "glaciers", "the printing press", "honeybees",
          "electric motors", "the water cycle", "chess openings", "sourdough bread", "tides"]
QUESTIONS = [ASKS[i % len(ASKS)].format(TOPICS[i % len(TOPICS)]) for i in range(len(ASKS) * len(TOPICS))]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_get(url: str, timeout=5.0):
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.status, r.read()


def tail(path: Path, lines=40) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def start_server(name, model, args, log: Path, decode_concurrency=None):
    """Start a server process; return it and its base URL."""
    port = free_port()
    if name == "paged":
        cmd = [sys.executable, "-m", "llm_paged_mlx", "serve", model, "--host", "127.0.0.1",
               "--port", str(port)]
        for kv in args.option:
            cmd += ["-o", *kv.split("=", 1)]
    else:  # same max_tokens and temperature as the requests
        cmd = [sys.executable, "-m", "mlx_lm.server", "--model", model, "--host", "127.0.0.1",
               "--port", str(port), "--max-tokens", str(args.max_tokens), "--temp", "0",
               "--decode-concurrency", str(decode_concurrency)]
    print(f"$ {' '.join(cmd)}", flush=True)
    return subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT), f"http://127.0.0.1:{port}"


def wait_ready(name, proc, base, log: Path, timeout):
    """Poll /health until 200; return the model name that requests must send."""
    started, deadline = time.time(), time.time() + timeout
    while True:
        if proc.poll() is not None:
            sys.exit(f"{name} server exited with code {proc.returncode} before it was ready:\n{tail(log)}")
        if time.time() > deadline:
            sys.exit(f"{name} server not ready after {timeout} s:\n{tail(log)}")
        try:
            if http_get(base + "/health")[0] == 200:
                break
        except OSError:  # refused while starting, HTTPError 503 while loading
            if "generation thread died" in log.read_text(errors="replace"):  # mlx_lm.server stays up, 503
                sys.exit(f"{name} server failed to load the model:\n{tail(log)}")
        time.sleep(0.5)
    print(f"{name} /health 200 after {time.time() - started:.1f} s", flush=True)
    if name == "paged":
        model_name = json.loads(http_get(base + "/v1/models")[1])["data"][0]["id"]
    else:  # mlx_lm.server maps "default_model" to --model; another name would load that model
        model_name = "default_model"
    return model_name


def stop_server(proc):
    for sig, wait in ((signal.SIGINT, 15), (signal.SIGTERM, 10), (signal.SIGKILL, 10)):
        if proc.poll() is not None:
            return
        proc.send_signal(sig)
        try:
            proc.wait(wait)
        except subprocess.TimeoutExpired:
            pass


async def one_request(client, model_name, question, max_tokens):
    sent = time.perf_counter()
    first = last = None
    itl, chunks, usage = [], 0, None
    stream = await client.chat.completions.create(
        model=model_name, messages=[{"role": "user", "content": question}], max_tokens=max_tokens,
        temperature=0, stream=True, stream_options={"include_usage": True})
    async for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage.completion_tokens
        if chunk.choices and chunk.choices[0].delta.content:
            now = time.perf_counter()
            if first is None:
                first = now
            else:
                itl.append(now - last)
            last, chunks = now, chunks + 1
    return {"ttft": None if first is None else first - sent, "itl": itl, "chunks": chunks,
            "tokens": chunks if usage is None else usage, "usage": usage is not None}


async def one_request_or_error(client, model_name, question, max_tokens):
    """A failed request is counted, not fatal (and its exception, which may not pickle, stays here)."""
    try:
        return await one_request(client, model_name, question, max_tokens)
    except Exception as e:
        return {"error": f"{type(e).__name__}: {e}"}


def make_client(base):
    key = os.environ.get("LLM_PAGED_MLX_API_KEY", "none")  # our server demands it when it is set
    return openai.AsyncOpenAI(base_url=base + "/v1", api_key=key, timeout=3600, max_retries=0)


async def warm_up(base, model_name, max_tokens):
    async with make_client(base) as client:
        return await one_request(client, model_name, "Say hello.", max_tokens)


async def some_clients(base, model_name, clients, args, offset, start_at):
    """Clients ``clients`` (numbers out of N), from ``start_at`` (time.time()); their results and end time."""
    async with make_client(base) as client:

        async def one_client(c):
            await asyncio.sleep(c * args.stagger_ms / 1000)  # mlx_lm.server's listen backlog is 5 connections
            qs = [QUESTIONS[(offset + c * args.requests_per_client + r) % len(QUESTIONS)]
                  for r in range(args.requests_per_client)]
            return [await one_request_or_error(client, model_name, q, args.max_tokens) for q in qs]

        await asyncio.sleep(max(0.0, start_at - time.time()))
        per_client = await asyncio.gather(*(one_client(c) for c in clients))
    return [r for rs in per_client for r in rs], time.time()


def client_process(job):
    return asyncio.run(some_clients(*job))


def run_clients(base, model_name, n, args, offset):
    """N clients in ``--client-processes`` processes (one Python process parsing every stream's chunks can be
    the bottleneck at hundreds of clients); all results, and the wall time from the common start to the last end."""
    processes = min(args.client_processes, n)
    start_at = time.time() + 1.0 + 0.2 * processes  # once every process is up
    jobs = [(base, model_name, range(p, n, processes), args, offset, start_at) for p in range(processes)]
    if processes == 1:
        outputs = [client_process(jobs[0])]
    else:
        with multiprocessing.get_context("spawn").Pool(processes) as pool:
            outputs = pool.map(client_process, jobs)
    return [r for results, _ in outputs for r in results], max(end for _, end in outputs) - start_at


def pct(xs, q):
    """Percentile q (0-100) by linear interpolation; None for no data."""
    if not xs:
        return None
    xs = sorted(xs)
    k = (len(xs) - 1) * q / 100
    lo = int(k)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def ms(seconds):
    return None if seconds is None else seconds * 1e3


def summarize(server, n, results, wall):
    errors = [r["error"] for r in results if "error" in r]
    results = [r for r in results if "error" not in r]
    ttfts = [r["ttft"] for r in results if r["ttft"] is not None]
    itls = [x for r in results for x in r["itl"]]
    tokens = sum(r["tokens"] for r in results)
    return {"server": server, "clients": n, "requests": len(results), "failed": len(errors),
            "first_error": errors[0] if errors else None, "wall_s": wall,
            "req_per_s": len(results) / wall, "tok_per_s": tokens / wall, "output_tokens": tokens,
            "tokens_per_chunk": tokens / max(1, sum(r["chunks"] for r in results)),
            "usage_sent": bool(results) and all(r["usage"] for r in results),
            **{f"{k}_p{q}_ms": ms(pct(xs, q)) for k, xs in (("ttft", ttfts), ("itl", itls)) for q in (50, 99)}}


def save_random_qwen3(src: Path, dst: Path):
    """Save a random-weight Qwen3-0.6B-shaped bf16 model to ``dst``, with ``src``'s tokenizer."""
    import mlx.core as mx
    from mlx.utils import tree_flatten, tree_map
    from mlx_lm.models import qwen3
    src_config = json.loads((src / "config.json").read_text())
    config = dict(model_type="qwen3", hidden_size=1024, num_hidden_layers=28, intermediate_size=3072,
                  num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                  vocab_size=src_config["vocab_size"], rope_theta=1_000_000.0,
                  max_position_embeddings=40960, rms_norm_eps=1e-6, tie_word_embeddings=True,
                  bos_token_id=src_config.get("bos_token_id"), eos_token_id=src_config.get("eos_token_id"))
    mx.random.seed(0)
    model = qwen3.Model(qwen3.ModelArgs.from_dict(config))
    model.update(tree_map(lambda p: p.astype(mx.bfloat16), model.parameters()))
    dst.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(dst / "model.safetensors"), dict(tree_flatten(model.parameters())),
                        metadata={"format": "mlx"})
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    for f in src.glob("tokenizer*"):
        shutil.copy(f, dst / f.name)
    del model
    mx.clear_cache()


def version(package):
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "absent"


def fmt(x, digits=1):
    return "-" if x is None else f"{x:.{digits}f}"


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True, help="an mlx-lm model folder")
    p.add_argument("--clients", default="1,4,16", type=lambda s: [int(x) for x in s.split(",")])
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--requests-per-client", type=int, default=2)
    p.add_argument("--servers", default="paged,mlx_lm", type=lambda s: s.split(","))
    p.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                   help="passed to our server as -o KEY VALUE (repeatable)")
    p.add_argument("--ready-timeout", type=float, default=600,
                   help="seconds to wait for a server to load")
    p.add_argument("--save-random-qwen3", metavar="DIR",
                   help="save a random Qwen3-0.6B-shaped model (--model's tokenizer) to DIR; serve that")
    p.add_argument("--client-processes", type=int, default=1,
                   help="processes the clients are spread over (use several on a machine with many cores)")
    p.add_argument("--stagger-ms", type=float, default=2.0,
                   help="client c starts c times this late (both servers; mlx_lm.server resets connections that "
                        "arrive faster than its backlog of 5 is accepted)")
    p.add_argument("--mlx-lm-decode-concurrency", metavar="N[,N...]",
                   type=lambda s: [int(x) for x in s.split(",")],
                   help="mlx_lm.server's --decode-concurrency; several values run it once each and ours is "
                        "compared with the best (default: the most clients, at least its own default of 32)")
    p.add_argument("--json", metavar="OUT", help="also write the results as JSON")
    args = p.parse_args()
    unknown = set(args.servers) - {"paged", "mlx_lm"}
    if unknown:
        sys.exit(f"unknown servers {sorted(unknown)}; choose from paged, mlx_lm")
    model = str(Path(args.model).expanduser().resolve())
    if args.save_random_qwen3:
        dst = Path(args.save_random_qwen3).expanduser().resolve()
        save_random_qwen3(Path(model), dst)
        model = str(dst)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit("terminated"))  # so that finally stops the server

    header = (f"{datetime.date.today()}, {platform.platform()}, {os.cpu_count()} CPUs, Python "
              f"{platform.python_version()}, mlx {version('mlx')}, mlx-lm {version('mlx-lm')}; model "
              f"{Path(model).name}; {args.requests_per_client} streaming requests per client, "
              f"max_tokens {args.max_tokens}, temperature 0, EOS honoured; clients in {args.client_processes} "
              f"process(es); a distinct question per request "
              f"(the same sequence for both servers, {len(QUESTIONS)} before they repeat)")
    print(header, flush=True)
    if "quantization" in json.loads((Path(model) / "config.json").read_text()):
        print("note: quantized weights; on the CPU our server dequantizes them at load, mlx_lm.server does not")
    concurrencies = args.mlx_lm_decode_concurrency or [max(32, max(args.clients))]
    runs = [("paged", "paged", None)] if "paged" in args.servers else []
    if "mlx_lm" in args.servers:
        runs += [("mlx_lm" if len(concurrencies) == 1 else f"mlx_lm dc={c}", "mlx_lm", c) for c in concurrencies]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for label, name, concurrency in runs:
            log = Path(tmp) / f"{name}-{concurrency}.log"
            proc, base = start_server(name, model, args, log, concurrency)
            try:  # the server is stopped however this ends (errors, Ctrl-C, SIGTERM)
                model_name = wait_ready(name, proc, base, log, args.ready_timeout)
                started = time.time()
                w = asyncio.run(warm_up(base, model_name, args.max_tokens))
                print(f"{label} warm-up: {w['tokens']} tokens in {time.time() - started:.1f} s "
                      f"(usage chunk {'sent' if w['usage'] else 'NOT sent'})", flush=True)
                offset = 0
                for n in args.clients:
                    results, wall = run_clients(base, model_name, n, args, offset)
                    offset += n * args.requests_per_client
                    rows.append(summarize(label, n, results, wall))
                    r = rows[-1]
                    failed = f", {r['failed']} FAILED ({r['first_error']})" if r["failed"] else ""
                    print(f"  {label} N={n}: {r['tok_per_s']:.1f} tok/s, "
                          f"TTFT p99 {fmt(r['ttft_p99_ms'], 0)} ms{failed}", flush=True)
            finally:
                stopping = time.time()
                stop_server(proc)
                print(f"{label} stopped in {time.time() - stopping:.1f} s (exit code {proc.returncode})",
                      flush=True)

    print("\n" + header + "\n")
    print("| server | clients | req/s | failed | output tok/s | TTFT p50 ms | TTFT p99 ms | ITL p50 ms "
          "| ITL p99 ms | tokens/request | tokens/chunk |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['server']} | {r['clients']} | {r['req_per_s']:.2f} | {r['failed']} | {r['tok_per_s']:.1f} "
              f"| {fmt(r['ttft_p50_ms'])} | {fmt(r['ttft_p99_ms'])} | {fmt(r['itl_p50_ms'])} "
              f"| {fmt(r['itl_p99_ms'])} | {r['output_tokens'] / max(1, r['requests']):.1f}"
              f"{'' if r['usage_sent'] else ' (no usage: chunks counted)'} | {r['tokens_per_chunk']:.2f} |")
    ours_at = {r["clients"]: r for r in rows if r["server"] == "paged"}
    best_mlx_lm_at = {}  # the fastest mlx_lm.server run at each client count
    for r in sorted((r for r in rows if r["server"] != "paged"), key=lambda r: r["tok_per_s"]):
        best_mlx_lm_at[r["clients"]] = r
    paired = [n for n in args.clients if n in ours_at and n in best_mlx_lm_at]
    if paired:
        print("\n| clients | output tok/s, ours / mlx_lm.server | TTFT p99, ours / mlx_lm.server | mlx_lm.server run |")
        print("|---:|---:|---:|---|")
        for n in paired:
            ours, theirs = ours_at[n], best_mlx_lm_at[n]
            ttft = (ours["ttft_p99_ms"] / theirs["ttft_p99_ms"]
                    if ours["ttft_p99_ms"] and theirs["ttft_p99_ms"] else None)
            ratio = ours["tok_per_s"] / theirs["tok_per_s"] if theirs["tok_per_s"] else float("inf")
            print(f"| {n} | {ratio:.2f} | {fmt(ttft, 2)} | {theirs['server']} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"header": header, "model": model, "args": vars(args),
                                               "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
