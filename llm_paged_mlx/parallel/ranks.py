"""The processes (ranks) of a tensor-parallel group: joining one, and starting one on this machine.

``serve --tensor-parallel N`` runs its own command as N ranks (``cli``). A
model prompted with ``-o tensor_parallel N`` (``llm -m``, or
``engines.engine_loop`` from Python) instead makes this process rank 0 and
starts the other ranks as followers (``python -m llm_paged_mlx.engines``), which
make rank 0's engine calls on their shards (``parallel.mirror``) and end when
rank 0 does: it tells them at its loop's end, and if it dies they find it
gone. Between messages they sleep on a doorbell: a byte rank 0 writes to
their stdin before each.
"""

import faulthandler
import json
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable, Optional

from ..errors import one_line

LAUNCHED_RANK = "MLX_RANK"  # set in every rank (by mlx.launch, serve, or lead)
LOCAL_BACKENDS = ("ring", "nccl")  # the backends that start ranks on this machine without mlx.launch
JOIN_TIMEOUT_S = 120.0  # how long lead waits for its followers to start and connect
PARENT_CHECK_S = 1.0  # how often a follower checks that its rank 0 is still running
READY = b"ready\n"  # what a follower says once it is about to join
DOORBELL = b"!"  # what rank 0 writes to each follower's stdin before a message


def default_backend() -> str:
    """nccl with CUDA, else ring."""
    import mlx.core as mx

    return "nccl" if mx.cuda.is_available() else "ring"


def join(size: int, backend: Optional[str]):
    """This rank's group, of ``size`` ranks; ValueError if the backend does not start or another number
    of ranks was started."""
    import mlx.core as mx

    backend = backend or default_backend()
    try:
        group = mx.distributed.init(strict=True, backend=backend)
    except RuntimeError as e:  # the backend is not in this build of MLX, or cannot connect
        raise ValueError(f"tensor parallel: MLX's {backend} backend did not start ({one_line(e)})") from None
    if group.size() != size:
        raise ValueError(f"tensor parallel over {size} ranks, but {group.size()} were started")
    return group


def local_env(size: int, backend: str, folder: str) -> list[dict]:
    """Each rank's environment for ``size`` ranks on this machine, as ``mlx.launch -n size`` sets it
    (ring: a hostfile of local ports written into ``folder``; nccl: one visible GPU per rank)."""
    if backend not in LOCAL_BACKENDS:
        raise ValueError(f"backend {backend} joins machines: give their hostfile (see mlx.launch --help)")
    if backend == "nccl":
        shared = {"NCCL_HOST_IP": "127.0.0.1", "NCCL_PORT": str(_free_port()), "MLX_WORLD_SIZE": str(size)}
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        gpus = [g for g in visible.split(",") if g] if visible is not None else [str(g) for g in range(_gpu_count())]
        if len(gpus) < size:
            raise ValueError(f"tensor parallel over {size} GPUs, but this process sees {len(gpus)}")
        return [{**shared, LAUNCHED_RANK: str(r), "CUDA_VISIBLE_DEVICES": gpus[r]} for r in range(size)]
    hosts = Path(folder) / "hosts.json"
    hosts.write_text(json.dumps([[f"127.0.0.1:{_free_port()}"] for _ in range(size)]))
    return [{LAUNCHED_RANK: str(r), "MLX_HOSTFILE": str(hosts)} for r in range(size)]


def _gpu_count() -> int:
    import mlx.core as mx

    return mx.device_count(mx.gpu)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Led:
    """The group this process leads, the model its followers serve, the followers, and what their
    hostfile needs."""

    def __init__(self, size: int, folder: str, group, followers: list, files: tempfile.TemporaryDirectory):
        self.size, self.folder, self.group, self.followers, self.files = size, folder, group, followers, files

    def ring(self) -> None:
        """Wake the followers for a message (each waits for a byte on its stdin: ``_wait_for_rank_zero``)."""
        for rank, follower in enumerate(self.followers, 1):
            try:
                follower.stdin.write(DOORBELL)
                follower.stdin.flush()
            except OSError:  # its end of the pipe is closed: it has ended
                raise RuntimeError(f"rank {rank} has ended (status {follower.poll()})") from None


_LED: Optional[_Led] = None
_LED_LOCK = threading.Lock()
_JOIN_FAILED: Optional[str] = None  # why this process could not start its group (MLX joins once per process)


def lead(size: int, folder: str, model_id: str, follower: str, backend: Optional[str] = None):
    """The group of ``size`` ranks on this machine that this process leads as rank 0, started if needed,
    and its doorbell (for ``mirror.share``): the other ranks run ``python -m follower FOLDER MODEL_ID
    BACKEND SIZE LEAD_PID`` (which calls ``follow``) and follow the engines built from the model in
    ``folder``.

    A process joins one group in its life, so it leads ranks for one model and size; ValueError for
    another, or when the ranks could not start (then for good)."""
    global _LED, _JOIN_FAILED
    with _LED_LOCK:
        if _LED is not None:
            if (_LED.size, _LED.folder) != (size, folder):
                raise ValueError(f"this process already runs {_LED.folder} over {_LED.size} ranks: one model "
                                 "and one number of ranks per process")  # fmt: skip
            if any(follower.poll() is not None for follower in _LED.followers):  # told to stop, or dead
                raise ValueError("tensor parallel: the other ranks of this process have ended; restart the process")
            return _LED.group, _LED.ring
        if _JOIN_FAILED is not None:
            raise ValueError(f"tensor parallel: the ranks could not start ({_JOIN_FAILED}); restart the process")
        files = tempfile.TemporaryDirectory(prefix="llm-paged-mlx-ranks-")  # removed at this process's exit
        backend = backend or default_backend()
        envs = local_env(size, backend, files.name)
        command = [sys.executable, "-m", follower, folder, model_id, backend, str(size), str(os.getpid())]
        safe_path = {"PYTHONSAFEPATH": "1"}  # -m would put the current directory first on the import path
        followers = [
            subprocess.Popen(command, env={**os.environ, **safe_path, **env}, stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE)  # fmt: skip
            for env in envs[1:]
        ]
        try:
            _wait_until_ready(followers)
            group = _join_as_rank_zero(size, backend, envs[0])
        except ValueError as e:
            for follower in followers:
                follower.kill()
            _JOIN_FAILED = one_line(e) if not isinstance(e, _NotReady) else None
            raise
        _LED = _Led(size, folder, group, followers, files)
        return group, _LED.ring


class _NotReady(ValueError):
    """A follower ended, or was not ready in time, before any rank joined (a later lead may try again)."""


def _wait_until_ready(followers: list) -> None:
    """Wait until every follower is about to join (it says so on its stdout). The backends wait for good
    for a rank that never connects, holding Python's lock, so a follower that ends before is caught here."""
    deadline = time.monotonic() + JOIN_TIMEOUT_S
    for rank, follower in enumerate(followers, 1):
        while not select.select([follower.stdout], [], [], 0.1)[0]:
            if time.monotonic() > deadline:
                raise _NotReady(f"tensor parallel: rank {rank} was not ready within {JOIN_TIMEOUT_S:.0f} s")
        if follower.stdout.readline() != READY:  # the pipe's end: it ended
            raise _NotReady(f"tensor parallel: rank {rank} ended with status {follower.wait()} before it joined")
        follower.stdout.close()


def _join_as_rank_zero(size: int, backend: str, env: dict):
    """``join`` with ``env`` (where this rank is) in the environment the backend reads. Should a follower
    die between saying it is ready and connecting, the join would wait for good: past ``JOIN_TIMEOUT_S``
    the process ends with the stack of where it waited."""
    saved = dict(os.environ)
    os.environ.update(env)
    faulthandler.dump_traceback_later(JOIN_TIMEOUT_S, exit=True)
    try:
        return join(size, backend)
    finally:
        faulthandler.cancel_dump_traceback_later()
        os.environ.clear()
        os.environ.update(saved)


def replay(build, group, doorbell=None) -> None:
    """On a rank other than 0: build (``build(options, weights)``, ``engines.engine_builder``'s) and step
    this rank's engines as rank 0 says (``mirror.follow``) until it stops; the process ends with the reason
    if the group or this rank's engine fails (rank 0's next collective fails too). Ctrl-C is left to rank 0
    (a terminal sends it to every process of the job)."""
    from . import mirror  # mlx: only in a rank's process

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        mirror.follow(build, group, doorbell)
    except Exception as e:
        sys.exit(f"llm-paged-mlx: rank {group.rank()} of the tensor-parallel group: {one_line(e)}")


def follow(backend: str, size: int, lead_pid: int, builder: Callable) -> None:
    """A follower started by ``lead``: join, then ``replay`` the engines ``builder(group)`` builds, with a
    doorbell, until rank 0 stops."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    threading.Thread(target=_end_with_parent, args=(lead_pid,), daemon=True).start()
    os.write(sys.stdout.fileno(), READY)  # then nothing more goes to the pipe rank 0 read that from
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    try:
        group = join(size, backend)
    except ValueError as e:
        sys.exit(f"llm-paged-mlx: rank {os.environ.get(LAUNCHED_RANK)} of the tensor-parallel group: {e}")
    replay(builder(group), group, _wait_for_rank_zero)


def _wait_for_rank_zero() -> None:
    """A follower's doorbell: wait (without polling) until rank 0 rings, or has ended."""
    if os.read(sys.stdin.fileno(), 1) != DOORBELL:
        raise RuntimeError("rank 0 has ended")


def _end_with_parent(parent: int) -> None:
    """End this follower once its rank 0 (its parent) has ended: a backend's wait does not always
    notice a peer that is gone."""
    while os.getppid() == parent:
        time.sleep(PARENT_CHECK_S)
    print(f"llm-paged-mlx: rank {os.environ.get(LAUNCHED_RANK)}: rank 0 ended; ending too", file=sys.stderr, flush=True)
    os._exit(1)
