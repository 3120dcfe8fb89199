"""Ctrl-C during generation: the real ``llm`` CLI ends with click's "Aborted!", never a signal death.

MLX work runs on a thread of the plugin's; when the process tore down while that thread was
inside MLX, SIGINT ended ``llm`` with SIGABRT ("terminate called without an active exception")
or SIGSEGV. Each run here loads the model afresh (about 4 s on 2 cores, most of it Python's imports on one
core): the ten interrupted runs of the first test go two at a time, in the same user directory.
"""

import json
import os
import random
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from mlx_lm.generate import stream_generate
from mlx_lm.sample_utils import make_sampler
from smollm2 import smollm2_dir

from llm_paged_mlx.catalog import CACHE_ENV
from llm_paged_mlx.files import TEMP_PREFIX
from llm_paged_mlx.models.loading import load_model

STORY = "Write a long story about a dragon who learns to read."
LLM = Path(sys.executable).parent / "llm"
AT_ONCE = 2  # interrupted runs at a time


def start_llm(user_dir: Path, *args) -> subprocess.Popen:
    """``llm -m paged-smollm2 ...`` in a process of its own; a small K/V pool keeps start-up short."""
    env = {**os.environ, "LLM_USER_PATH": str(user_dir), CACHE_ENV: str(smollm2_dir().parent)}
    command = [LLM, "-m", "paged-smollm2", "-o", "kv_budget", "32MB", *map(str, args)]
    return subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def interrupt(user_dir: Path, *delays: float) -> subprocess.CompletedProcess:
    """Start a long answer and send SIGINT after its first output, waiting ``delays`` before each."""
    process = start_llm(user_dir, "-o", "max_tokens", 2000, STORY)
    first = process.stdout.read(1)  # generation has begun
    for delay in delays:
        time.sleep(delay)
        process.send_signal(signal.SIGINT)
    stdout, stderr = process.communicate(timeout=120)
    assert first, stderr.decode()
    return subprocess.CompletedProcess(process.args, process.returncode, first + stdout, stderr.decode())


def interrupts(user_dir: Path, delays: list[tuple[float, ...]]) -> list[subprocess.CompletedProcess]:
    """``interrupt(user_dir, *d)`` for each ``d`` of ``delays``, AT_ONCE at a time; the first alone in a new
    user directory, where llm creates its logs database (two processes at once would both migrate it)."""
    results = []
    if not (user_dir / "logs.db").exists():
        results.append(interrupt(user_dir, *delays[0]))
        delays = delays[1:]
    with ThreadPoolExecutor(AT_ONCE) as pool:
        return results + list(pool.map(lambda d: interrupt(user_dir, *d), delays))


def test_ctrl_c_during_generation_exits_cleanly_and_leaves_no_stray_files(tmp_path):
    user_dir = tmp_path / "llm"
    for result in interrupts(user_dir, [(random.uniform(0, 1.0),) for _ in range(10)]):
        assert result.returncode in (1, 130) and "Aborted!" in result.stderr, (result.returncode, result.stderr)
    kv_cache = user_dir / "paged-mlx" / "kv-cache"
    assert list(kv_cache.glob("*.safetensors"))  # the interrupted requests' blocks were written
    temporary = [p.name for p in (user_dir / "paged-mlx").rglob("*") if p.name.startswith((TEMP_PREFIX, ".models."))]
    assert not temporary  # of the KV disk cache's writer or the model registry

    process = start_llm(user_dir, "-o", "max_tokens", 24, STORY)
    expected = mlx_lm_answer(STORY, 24) + "\n"  # while the process starts
    stdout, stderr = process.communicate(timeout=120)
    assert process.returncode == 0 and not stderr, stderr
    assert stdout.decode() == expected
    logs = subprocess.run([LLM, "logs", "--json", "-n", "1"], env={**os.environ, "LLM_USER_PATH": str(user_dir)},
                          capture_output=True, text=True, check=True)
    assert json.loads(logs.stdout)[0]["response_json"]["disk_cache_hit_tokens"] >= 16  # blocks read back intact


def test_a_second_ctrl_c_while_stopping_still_exits_cleanly(tmp_path):
    for second in (0.02, 0.2):
        result = interrupt(tmp_path / "llm", random.uniform(0, 0.5), second)
        assert result.returncode in (1, 130), (result.returncode, result.stderr)


def mlx_lm_answer(question: str, max_tokens: int) -> str:
    """mlx-lm's greedy answer on the weights as load_model gives them."""
    model, tokenizer = load_model(str(smollm2_dir()))
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True)
    responses = stream_generate(model, tokenizer, prompt, max_tokens=max_tokens, sampler=make_sampler(temp=0.0))
    return "".join(r.text for r in responses)
