"""Test helper: this process leads a tensor-parallel group whose followers it starts (``ranks.lead``), and a
follower fails or idles (started by tests/test_tensor_parallel.py).

    python tensor_parallel_lead.py CASE MODEL_FOLDER

It prints each error it meets, one per line, as ``error: <type>: <message>``, and exits.
"""

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from llm_paged_mlx import engines
from llm_paged_mlx.parallel import ranks
from llm_paged_mlx.engine.request import SamplingParams
from llm_paged_mlx.options import PagedOptions, serving_config

CONFIG = serving_config(PagedOptions(kv_budget="32MB"))


def report(error: Exception) -> None:
    print(f"error: {type(error).__name__}: {error}", flush=True)


def follower_dies(folder: str) -> None:
    """A prompt runs over two ranks; then the follower is killed, and the next prompt gets an error, as
    does a prompt to a new loop for the same model (the group cannot start again in this process)."""
    loop = engines.engine_loop("tiny", folder, lambda: folder, tensor_parallel=2)
    text = "".join(chunk.text or "" for chunk in loop.submit("Hello", SamplingParams(max_tokens=4), CONFIG))
    print(f"answered: {text!r}", flush=True)
    follower = subprocess.run(["pgrep", "-f", f"llm_paged_mlx.engines {folder}"], capture_output=True, text=True)
    os.kill(int(follower.stdout.split()[0]), signal.SIGKILL)
    for _ in range(2):
        try:
            list(loop.submit("Hello again", SamplingParams(max_tokens=4), CONFIG))
        except Exception as e:
            report(e)
        engines.stop_all()
        loop = engines.engine_loop("tiny", folder, lambda: folder, tensor_parallel=2)


def follower_idles(folder: str) -> None:
    """After a prompt, the follower waits for the next without polling: prints the share of a core it used
    over 3 s of rank 0 idle."""
    loop = engines.engine_loop("tiny", folder, lambda: folder, tensor_parallel=2)
    list(loop.submit("Hello", SamplingParams(max_tokens=4), CONFIG))
    follower = subprocess.run(["pgrep", "-f", f"llm_paged_mlx.engines {folder}"], capture_output=True, text=True)
    stat = Path(f"/proc/{follower.stdout.split()[0]}/stat")

    def cpu_seconds() -> float:
        fields = stat.read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime

    time.sleep(0.5)  # past the step's own end
    before = cpu_seconds()
    time.sleep(3)
    print(f"idle follower: {(cpu_seconds() - before) / 3:.3f} of a core", flush=True)


def follower_cannot_start(folder: str) -> None:
    """The followers end before they join (here: their interpreter is one that exits at once); a later lead
    tries again (and here fails the same way)."""
    sys.executable = "/bin/false"
    for _ in range(2):
        try:
            ranks.lead(2, folder, "tiny", follower=engines.__name__)
        except ValueError as e:
            report(e)


def follower_dies_joining(folder: str) -> None:
    """The follower says it is ready, then ends before it connects: the join would wait for good, so the
    process ends after the join's timeout (shortened here)."""
    fake = Path(tempfile.mkdtemp()) / "ready-then-gone"
    fake.write_text(f"#!/bin/sh\nprintf '{ranks.READY.decode().strip()}\\n'\n")
    fake.chmod(0o755)
    sys.executable, ranks.JOIN_TIMEOUT_S = str(fake), 3.0
    ranks.lead(2, folder, "tiny", follower=engines.__name__)
    print("joined", flush=True)  # not reached


CASES = {"follower-dies": follower_dies, "follower-idles": follower_idles, "follower-cannot-start": follower_cannot_start,
         "follower-dies-joining": follower_dies_joining}  # fmt: skip

if __name__ == "__main__":
    CASES[sys.argv[1]](sys.argv[2])
