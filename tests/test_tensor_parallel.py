"""Tensor parallelism: two ranks over MLX's ring backend on this machine, each holding half of a model's heads.

Each rank is a process of its own running tests/tensor_parallel_rank.py, as ``mlx.launch`` would start it.
"""

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import mlx.nn as nn
import pytest
from models import tiny_model
from smollm2 import smollm2_dir
from tensor_parallel_rank import MAX_TOKENS, QUESTIONS, SMOLLM2_TOKENS, requests
from test_engine import random_prompts, reference
from test_engine_smollm2 import chat
from test_speculative import repeating_prompts

from llm_paged_mlx import Engine, SamplingParams, cli
from llm_paged_mlx.parallel import mirror

RANKS = 2
HERE = Path(__file__).parent


def ranks_env(**variables: str) -> dict:
    """The environment of processes that start ranks: this one's, with ``variables``, and OpenBLAS on one
    thread a rank. The ranks share this machine's few cores, and a BLAS thread that spins after its product
    takes the core another rank's collective waits for."""
    return {**os.environ, "OPENBLAS_NUM_THREADS": "1", **variables}


def free_ports(n: int) -> list[int]:
    sockets = [socket.socket() for _ in range(n)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


def run_ranks(tmp_path, case: str, arch: str, size: int = RANKS) -> list[dict]:
    """Run the case on ``size`` ranks; what each wrote."""
    hosts = tmp_path / "hosts.json"
    hosts.write_text(json.dumps([[f"127.0.0.1:{port}"] for port in free_ports(size)]))
    outs = [tmp_path / f"rank{rank}.json" for rank in range(size)]
    env = ranks_env(MLX_HOSTFILE=str(hosts), PYTHONPATH=f"{HERE}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    ranks = [
        subprocess.Popen(
            [sys.executable, str(HERE / "tensor_parallel_rank.py"), case, arch, str(out)],
            env={**env, "MLX_RANK": str(rank)}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        for rank, out in enumerate(outs)
    ]  # fmt: skip
    try:
        logs = [rank.communicate(timeout=300)[0] for rank in ranks]
    finally:
        for rank in ranks:
            rank.kill()
    for rank, log in zip(ranks, logs):
        assert rank.returncode == 0 or (case == "dies" and rank is ranks[-1]), log
    return [json.loads(out.read_text()) for out in outs if out.exists()]


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_two_ranks_give_mlx_lm_tokens_and_the_same_samples(tmp_path, arch):
    """Greedy requests get mlx-lm's tokens from the unsharded model; sampled ones without a seed, rank 0's
    draws on both ranks; under preemption, with the prefix cache, and every block back."""
    ranks = run_ranks(tmp_path, "tiny", arch)
    assert ranks[0]["tokens"] == ranks[1]["tokens"]
    model = tiny_model(arch)
    prompts, params = requests()
    for prompt, p, tokens in zip(prompts, params, ranks[0]["tokens"]):
        if p.temperature == 0:
            assert tokens == reference(model, prompt, MAX_TOKENS)
        else:
            assert len(tokens) == MAX_TOKENS
    for rank in ranks:
        assert rank["kv_heads"] == model.layers[0].self_attn.n_kv_heads // RANKS
        assert rank["preemptions"] > 0 and rank["prefix_cache_hit_tokens"] > 0
        assert rank["free_blocks"] == rank["num_blocks"]


def test_prompt_lookup_over_two_ranks_gives_mlx_lm_tokens_and_the_same_samples(tmp_path):
    """Every rank drafts and accepts alike: rank 0's tokens on both, greedy ones mlx-lm's, every block back."""
    ranks = run_ranks(tmp_path, "speculative", "llama")
    assert ranks[0]["tokens"] == ranks[1]["tokens"]
    model = tiny_model("llama")
    for i, (prompt, tokens) in enumerate(zip(repeating_prompts(6), ranks[0]["tokens"])):
        if i % 3 == 2:  # sampled
            assert len(tokens) == MAX_TOKENS
        else:
            assert tokens == reference(model, prompt, MAX_TOKENS)
    for rank in ranks:
        assert 0 < rank["accepted_draft_tokens"] < rank["draft_tokens"]
        assert rank["free_blocks"] == rank["num_blocks"]


def test_a_4_bit_model_over_two_ranks_gives_mlx_lm_tokens_with_its_sharded_layers_folding_rows(tmp_path):
    ranks = run_ranks(tmp_path, "quantized", "llama")
    model = tiny_model("llama")
    nn.quantize(model, group_size=32, bits=4)
    prompts, _ = requests()
    for rank in ranks:
        assert rank["tokens"] == [reference(model, prompt, MAX_TOKENS) for prompt in prompts[:3]]
        assert rank["sharded_layers"] == ["RowFoldedQuantizedAllToShardedLinear", "RowFoldedQuantizedShardedToAllLinear"]


def test_what_cannot_be_split_or_would_decide_differently_on_each_rank_is_refused(tmp_path):
    for rank in run_ranks(tmp_path, "refused", "llama"):
        assert rank["errors"] == [
            "llama: its 3 key value heads do not divide over 2 devices",
            "scheduler 'priority' ages requests by each rank's own clock: use 'fcfs' with tensor_parallel",
            "swap_policy 'disk' may decide differently on each rank: use 'recompute' or 'cpu' with tensor_parallel",
            "the ranks of a tensor-parallel engine were given different options: every rank must build the same engine",
        ] + ["the model is already sharded over devices: give the unsharded model with tensor_parallel=group, which "
             "shards it"] * 2  # fmt: skip


def test_a_rank_that_dies_ends_the_others_steps_with_an_error_not_a_hang(tmp_path):
    (survivor,) = run_ranks(tmp_path, "dies", "llama")
    assert "connection to a peer was lost" in survivor["error"] and "out of step" in survivor["error"]
    assert survivor["again"] == survivor["error"]


def run_benchmark(*args: str) -> tuple[int, str]:
    """``benchmarks/tensor_parallel.py`` (issue P's two-GPU runs) with a small model on this CPU: its status and
    output. It starts its ranks itself; they are ended with it, had it hung."""
    benchmarks = HERE.parent / "benchmarks"
    path = [str(HERE.parent), str(benchmarks), *filter(None, [os.environ.get("PYTHONPATH")])]
    launcher = subprocess.Popen(
        [sys.executable, str(benchmarks / "tensor_parallel.py"), "--small", "--new-tokens", "4", "--rounds", "1",
         "--kv-gib", "0.0625", *args],
        env=ranks_env(PYTHONPATH=os.pathsep.join(path)), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,
    )  # fmt: skip
    try:
        out = launcher.communicate(timeout=300)[0]
        return launcher.returncode, out
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(launcher.pid, signal.SIGKILL)


def test_the_two_gpu_benchmark_runs_here_over_ring_with_one_device_s_greedy_tokens():
    """Two ranks, each holding its shard of the weights, give the answers of the model whole on one device."""
    status, out = run_benchmark("--ranks", "2", "--concurrency", "1", "3", "--against-one")
    assert status == 0, out
    held, whole = map(float, re.search(r"rank 0 holds ([\d.]+) of the model's ([\d.]+) GiB", out).groups())
    assert held < 0.7 * whole  # the embeddings and the output head whole, half of every layer
    assert "| 1 of 1 |" in out and "| 3 of 3 |" in out, out


def test_the_two_gpu_benchmark_ends_every_rank_when_one_fails():
    """Heads that do not divide over 3 ranks: every rank fails, the reason is printed, the status is not 0."""
    status, out = run_benchmark("--ranks", "3", "--concurrency", "2")
    assert status != 0
    assert "ValueError: llama: its 8 attention heads do not divide over 3 devices" in out, out


def test_smollm2_over_three_ranks_answers_as_one_process(tmp_path):
    """SmolLM2's 9 query and 3 KV heads over 3 ranks, loaded lazily (each rank holds its shard): the greedy
    answers of the single-process engine."""
    ranks = run_ranks(tmp_path, "smollm2", "llama", size=3)
    engine = Engine.from_pretrained(str(smollm2_dir()), kv_budget_bytes=64 << 20)
    prompts = [chat(engine.tokenizer, q) for q in QUESTIONS]
    expected = [o.token_ids for o in engine.generate(prompts, SamplingParams(max_tokens=SMOLLM2_TOKENS))]
    for rank in ranks:
        assert rank["tokens"] == expected and rank["kv_heads"] == 1


# -- serving over ranks ---------------------------------------------------------------------------------

SERVED_PROMPTS = ["The capital of France is", "Once upon a time", "1, 2, 3,", "def main():", "Colors: red,"]
SERVED_TOKENS = 12


def tiny_model_folder(folder: Path, chat_template: bool = True) -> Path:
    """A random llama of 4 query and 2 KV heads with SmolLM2's tokenizer, as an mlx-lm model folder
    (without a chat template, a chat prompt is its text: random weights answer a template with newlines)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.models import llama

    config = dict(model_type="llama", vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, rope_theta=10000.0,
                  tie_word_embeddings=True, max_position_embeddings=2048)  # fmt: skip
    mx.random.seed(7)
    model = llama.Model(llama.ModelArgs.from_dict(config))
    folder.mkdir()
    mx.save_safetensors(str(folder / "model.safetensors"), dict(tree_flatten(model.parameters())))
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "tokenizer.json").write_bytes((smollm2_dir() / "tokenizer.json").read_bytes())
    tokenizer_config = json.loads((smollm2_dir() / "tokenizer_config.json").read_text())
    if not chat_template:
        del tokenizer_config["chat_template"]
    (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    return folder


def mlx_lm_continuation(folder: Path, prompt: str) -> str:
    """mlx-lm's greedy tokens after ``prompt`` as the text that continues it."""
    from mlx_lm import load
    from mlx_lm.generate import stream_generate
    from mlx_lm.sample_utils import make_sampler

    model, tokenizer = load(str(folder))
    pieces = stream_generate(model, tokenizer, prompt, max_tokens=SERVED_TOKENS, sampler=make_sampler(temp=0.0))
    generated = [r.token for r in pieces if r.token not in tokenizer.eos_token_ids]
    prompt_ids = tokenizer.encode(prompt)
    return tokenizer.decode(prompt_ids + generated)[len(tokenizer.decode(prompt_ids)) :]


class Served:
    """``serve FOLDER --tensor-parallel 2`` (ring backend) in a process group of its own, up."""

    def __init__(self, folder: Path, tmp_path: Path):
        import httpx

        (port,) = free_ports(1)
        self.folder, self.url = folder, f"http://127.0.0.1:{port}"
        env = ranks_env(LLM_USER_PATH=str(tmp_path / "llm"))
        command = [sys.executable, "-m", "llm_paged_mlx", "serve", str(folder), "--port", str(port),
                   "--tensor-parallel", "2", "--backend", "ring", "-o", "kv_budget", "32MB"]  # fmt: skip
        self.process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                        start_new_session=True)  # fmt: skip
        for _ in range(600):
            assert self.process.poll() is None, self.process.stdout.read()
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(0.2)
        raise AssertionError("the server did not start")

    def complete(self, prompt: str, max_tokens: int = SERVED_TOKENS):
        import httpx

        body = {"model": self.folder.name, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
        return httpx.post(f"{self.url}/v1/completions", json=body, timeout=120)

    def rank_pid(self, rank: int) -> int:
        """The process of ``rank``."""
        for pid in subprocess.run(["pgrep", "-f", str(self.folder)], capture_output=True, text=True).stdout.split():
            with contextlib.suppress(OSError):
                if f"MLX_RANK={rank}".encode() in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
                    return int(pid)
        raise AssertionError(f"no rank {rank}")

    def end(self, signum=None) -> str:
        """Its output once every process of its group has ended (after ``signum`` to the group, if given)."""
        try:
            if signum is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.process.pid, signum)
            return self.process.communicate(timeout=60)[0]
        finally:
            with contextlib.suppress(ProcessLookupError):  # all ended, as they should
                os.killpg(self.process.pid, signal.SIGKILL)

    def left(self) -> list[str]:
        """Processes of this server still running."""
        return subprocess.run(["pgrep", "-f", str(self.folder)], capture_output=True, text=True).stdout.split()


@pytest.mark.parametrize("ending", ["ctrl-c", "sigterm"])
def test_serve_over_two_ranks_gives_mlx_lm_text_and_ends_every_rank(tmp_path, ending):
    """``serve --tensor-parallel 2`` starts two ranks (ring backend); rank 0 serves HTTP. Concurrent greedy
    completions and a stream its client leaves mid-way (an abort both ranks must make) give mlx-lm's text.
    Ctrl-C in a terminal (SIGINT to the process group), or SIGTERM to the serve process alone (what a
    supervisor sends), ends every rank, with status 0."""
    import httpx

    folder = tiny_model_folder(tmp_path / "tiny-llama")
    served = Served(folder, tmp_path)
    try:
        body = {"model": folder.name, "prompt": "A long story:", "max_tokens": 200, "stream": True, "temperature": 0}
        with httpx.stream("POST", f"{served.url}/v1/completions", json=body, timeout=60) as stream:
            next(stream.iter_lines())  # one event, then the client leaves
        with ThreadPoolExecutor(len(SERVED_PROMPTS)) as pool:
            texts = [r.json()["choices"][0]["text"] for r in pool.map(served.complete, SERVED_PROMPTS)]
        assert texts == [mlx_lm_continuation(folder, p) for p in SERVED_PROMPTS]
    finally:
        if ending == "sigterm":
            served.process.terminate()
            log = served.end()
        else:
            log = served.end(signal.SIGINT)  # Ctrl-C in a terminal reaches the whole foreground group
    assert served.left() == [] and served.process.returncode == 0, log


def test_a_served_rank_that_dies_stops_the_server_with_the_reason(tmp_path):
    """The serve process ends the other ranks when one dies (or rank 0 finds its peer gone at its next
    step, and stops): no request hangs, every process ends, the output says why, and the status is not 0."""
    import httpx

    folder = tiny_model_folder(tmp_path / "tiny-llama")
    served = Served(folder, tmp_path)
    try:
        assert served.complete("Hello").status_code == 200
        os.kill(served.rank_pid(1), signal.SIGKILL)
        with contextlib.suppress(httpx.TransportError):  # or the server is already gone
            response = served.complete("Hello again")
            # 503: the server is stopping; 500: rank 0's step found the group failed
            assert response.status_code == 503 or "tensor-parallel group failed" in response.text, response.text
        log = served.end()  # no signal: the server stops by itself
    except BaseException:
        served.end(signal.SIGKILL)
        raise
    assert "rank 1 ended with status -9; ending the others" in log or "the tensor-parallel group failed" in log, log
    # the dead rank's status (128 + SIGKILL), or rank 0's if it stopped first (128 + SIGTERM)
    assert served.left() == [] and served.process.returncode in (137, 143)


# -- llm -m MODEL -o tensor_parallel N: this process leads, its followers are started for it ----------------

LLM = Path(sys.executable).parent / "llm"


def followers_of(folder: Path) -> list[str]:
    """Follower processes still running for ``folder``."""
    return subprocess.run(["pgrep", "-f", f"llm_paged_mlx.engines {folder}"], capture_output=True, text=True).stdout.split()


def test_an_llm_prompt_over_two_ranks_gives_mlx_lm_text_and_leaves_no_follower(tmp_path):
    """``llm -m MODEL -o tensor_parallel 2``: the llm process is rank 0 and starts rank 1 (ring, on the
    CPU); the answers are mlx-lm's greedy text, and the follower ends with llm. It imports what llm does,
    not a module of the current directory. A model whose heads do not divide by the ranks is refused,
    by name, with status 1, before any other rank starts."""
    folder = tiny_model_folder(tmp_path / "tiny-llama", chat_template=False)
    env = ranks_env(LLM_USER_PATH=str(tmp_path / "llm"))
    subprocess.run([LLM, "paged-mlx", "add", str(folder), "--alias", "tiny-tp"], env=env, check=True)
    here = tmp_path / "work"
    here.mkdir()
    (here / "select.py").write_text("raise SystemExit('the current directory was imported from')\n")
    options = ["-o", "max_tokens", str(SERVED_TOKENS), "-o", "kv_budget", "32MB"]
    for prompt in SERVED_PROMPTS[:2]:
        run = subprocess.run([LLM, "-m", "tiny-tp", "-o", "tensor_parallel", "2", *options, prompt],
                             env=env, cwd=here, capture_output=True, text=True, timeout=300)  # fmt: skip
        assert run.returncode == 0, run.stderr
        assert run.stdout.strip() == mlx_lm_continuation(folder, prompt).strip()
        assert followers_of(folder) == []
    run = subprocess.run([LLM, "-m", "tiny-tp", "-o", "tensor_parallel", "3", *options, "Hello"],
                         env=env, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert run.returncode == 1 and "Error: tiny-tp: llama: its 4 attention heads do not divide over 3" in run.stderr
    assert "rank 1" not in run.stderr and followers_of(folder) == []


def lead(case: str, folder: Path):
    """tests/tensor_parallel_lead.py's ``case`` over ``folder``, run to its end."""
    env = ranks_env(PYTHONPATH=f"{HERE}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    command = [sys.executable, str(HERE / "tensor_parallel_lead.py"), case, str(folder)]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)


def test_a_lead_whose_follower_dies_gets_the_reason_at_its_next_prompt(tmp_path):
    folder = tiny_model_folder(tmp_path / "tiny-llama")
    run = lead("follower-dies", folder)
    assert run.returncode == 0 and "answered: " in run.stdout, run.stderr
    first, again = [line for line in run.stdout.splitlines() if line.startswith("error: ")]
    assert first.startswith("error: StepFailed: ") and "the tensor-parallel group failed" in first, run.stdout
    assert again == "error: ModelLoadError: tiny: tensor parallel: the other ranks of this process have ended; " \
                    "restart the process"
    assert followers_of(folder) == []


def test_an_idle_follower_waits_for_rank_zero_without_polling(tmp_path):
    """Between messages a follower waits on its doorbell (a byte on its stdin), not in a collective,
    whose wait on ``ring`` keeps a core busy."""
    run = lead("follower-idles", tiny_model_folder(tmp_path / "tiny-llama"))
    assert run.returncode == 0, run.stderr
    share = float(run.stdout.split("idle follower: ")[1].split()[0])
    assert share < 0.2, run.stdout


def test_followers_that_end_before_they_join_are_an_error_not_a_hang(tmp_path):
    """The lead waits for its followers to be ready before it joins (a join waits for good for a rank that
    never connects): one that ends first is an error naming it, and a later lead may try again."""
    run = lead("follower-cannot-start", tmp_path)
    assert run.returncode == 0, run.stderr
    assert run.stdout.count("error: _NotReady: tensor parallel: rank 1 ended with status 1 before it joined") == 2


def test_a_follower_that_ends_while_joining_ends_the_lead_after_the_join_timeout(tmp_path):
    run = lead("follower-dies-joining", tmp_path)
    assert run.returncode == 1 and "joined" not in run.stdout
    assert "Timeout" in run.stderr and "in join" in run.stderr, run.stderr


def test_a_follower_ends_once_its_rank_zero_has_ended():
    """A backend does not always notice a peer that is gone, so a follower also watches its parent: here a
    parent that ends at once leaves a watcher that must end (a watcher that does not outlives the run's timeout,
    which bounds a hang)."""
    watcher = "import sys; from llm_paged_mlx.parallel import ranks; ranks._end_with_parent(int(sys.argv[1]))"
    parent = f"import os, subprocess, sys; subprocess.Popen([sys.executable, '-c', {watcher!r}, str(os.getpid())])"
    run = subprocess.run([sys.executable, "-c", parent], env={**os.environ, "MLX_RANK": "1"}, capture_output=True,
                         text=True, timeout=120)  # fmt: skip  (the pipe closes once the watcher has ended too)
    assert "rank 1: rank 0 ended; ending too" in run.stderr


# -- the mirror protocol, in one process ---------------------------------------------------------------


def test_a_follower_makes_rank_zeros_calls_under_its_own_request_ids(monkeypatch):
    """``follow`` replays rank 0's messages on its own engine: requests by rank 0's ids (here not its own),
    an abort of one of them, steps until the rest finish with mlx-lm's tokens, then stop; no block is kept."""
    model = tiny_model("llama")
    prompts = random_prompts([30, 50, 20])
    params = SamplingParams(max_tokens=8)
    messages = [[(mirror.BUILD, {})], [(mirror.ADD, 100 + i, p, params) for i, p in enumerate(prompts)] + [(mirror.STEP,)],
                [(mirror.ABORT, 101), (mirror.STEP,)]] + [[(mirror.STEP,)]] * 12 + [[(mirror.STOP,)]]  # fmt: skip
    monkeypatch.setattr(mirror, "share", lambda message, group, doorbell: messages.pop(0))
    built, tokens = [], {}

    def build(options, weights):
        engine = Engine(model, num_blocks=24)
        step = engine.step

        def recorded():
            chunks = step()
            for chunk in chunks:
                tokens.setdefault(chunk.request_id, []).extend(chunk.token_ids)
            return chunks

        engine.step = recorded
        built.append(engine)
        return engine

    mirror.follow(build, group=None)
    (engine,) = built
    assert messages == [] and not engine.has_unfinished()
    assert engine.blocks.num_free_blocks == engine.blocks.num_usable_blocks
    # The aborted request was the second: it ended before its first token came back (steps run ahead)
    first, third = sorted(tokens)  # the follower's ids, in the order rank 0 added the requests
    assert tokens[first] == reference(model, prompts[0], 8) and tokens[third] == reference(model, prompts[2], 8)


def test_rank_zero_is_told_once_when_the_group_fails(monkeypatch):
    def failed(message, group, doorbell):
        raise mirror.GroupFailed("the tensor-parallel group failed: [ring] connection to a peer was lost")

    failures = []
    monkeypatch.setattr(mirror, "share", failed)
    lead = mirror.LeadEngine(Engine(tiny_model("llama"), num_blocks=8), group=None, on_failure=failures.append)
    for _ in range(2):
        with pytest.raises(mirror.GroupFailed, match="connection to a peer was lost"):
            lead.step()
    with pytest.raises(mirror.GroupFailed, match="earlier; restart"):  # later steps say it is not new
        lead.step()
    assert len(failures) == 1  # once: a server stops once (a second SIGTERM would end it at once)
    lead.close()  # nothing more is sent to a failed group


def test_a_step_that_fails_on_rank_zero_fails_the_group_rather_than_retry_alone(monkeypatch):
    """The other ranks may have made the step: rank 0 retrying it alone would put them out of step."""
    failures = []
    monkeypatch.setattr(mirror, "share", lambda message, group, doorbell: None)
    engine = Engine(tiny_model("llama"), num_blocks=8)
    lead = mirror.LeadEngine(engine, group=None, on_failure=failures.append)
    lead.add_request([1, 2, 3], SamplingParams(max_tokens=4))
    monkeypatch.setattr(engine, "step", lambda: 1 / 0)
    with pytest.raises(mirror.GroupFailed, match="rank 0's step failed: division by zero"):
        lead.step()
    with pytest.raises(mirror.GroupFailed, match="rank 0's step failed: division by zero .earlier; restart"):
        lead.step()
    assert [str(f) for f in failures] == ["rank 0's step failed: division by zero"]


def test_a_server_whose_group_failed_stops_as_on_sigterm(monkeypatch, capsys):
    signals = []
    monkeypatch.setattr(cli.os, "kill", lambda pid, signum: signals.append((pid, signum)))
    cli._stop_serving(mirror.GroupFailed("the tensor-parallel group failed: [ring] connection to a peer was lost"))
    assert signals == [(os.getpid(), signal.SIGTERM)]
    assert "connection to a peer was lost; stopping the server" in capsys.readouterr().err
