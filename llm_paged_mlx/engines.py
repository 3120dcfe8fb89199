"""The models this process serves: one engine loop per model, its engine built for the options asked, and the
KV disk tiers the engines share.

llm registers models again on every ``get_model()``, so loops live here at module
level, keyed by model id and source. mlx and mlx-lm are imported only when a model
first runs, on its loop's thread.

``python -m llm_paged_mlx.engines FOLDER MODEL_ID BACKEND SIZE LEAD_PID`` is a
follower rank of a tensor-parallel group that rank 0 started (``parallel.ranks.lead``).
"""

import threading
from pathlib import Path
from typing import Callable, Optional

from .catalog import kv_disk_dir, model_source, plugin_dir
from .engine.loop import EngineLoop
from .errors import one_line
from .parallel import ranks


class ModelLoadError(RuntimeError):
    """A model could not be loaded or its engine built; the message names the model and the reason."""


_LOOPS: dict[tuple[str, str], EngineLoop] = {}
_LOOPS_LOCK = threading.Lock()
_DISK_CACHES: dict = {}  # one KVDiskCache per directory, model identity and budget (one writer per directory)


def engine_loop(
    model_id: str,
    source: str,
    fetch: Callable[[], str],
    max_waiting: Optional[int] = None,
    tensor_parallel: int = 1,
    group=None,
    on_group_failure: Optional[Callable[[Exception], None]] = None,
) -> EngineLoop:
    """The loop that serves ``model_id`` (from ``source``) over ``tensor_parallel`` ranks, started if needed.

    Each request's config is a ``options.ServingConfig``: another config rebuilds the engine once the requests before them end, reusing
    the loaded weights. With ``tensor_parallel`` > 1 the model is sharded over
    that many ranks on this machine, this process their rank 0, which start
    with the first engine (``ranks.lead``). With ``group`` (an
    ``mx.distributed`` group this process has joined as its rank 0) it is
    sharded over the group's ranks, which follow this loop's engine calls
    (``parallel.mirror``); ``on_group_failure`` is told once if the group fails.
    """
    size = group.size() if group is not None else tensor_parallel
    with _LOOPS_LOCK:
        loop = _LOOPS.get((model_id, source, size))
        if loop is None or loop.parked.is_set():
            build = engine_builder(model_id, fetch, group, size, on_group_failure)
            loop = _LOOPS[model_id, source, size] = EngineLoop(build, max_waiting=max_waiting, on_stop=_close_disk_caches)
        return loop


def stop_all() -> None:
    """Stop every loop (their requests end with ``LoopStopped``) and forget them; as at the process's exit."""
    with _LOOPS_LOCK:
        loops = list(_LOOPS.values())
        _LOOPS.clear()
    for loop in loops:
        loop.stop()
    _close_disk_caches()


def engine_builder(model_id: str, fetch: Callable[[], str], group=None, tensor_parallel: int = 1,
                   on_group_failure: Optional[Callable[[Exception], None]] = None):  # fmt: skip
    """``build(config, weights)``: the engine for ``config`` (a ``ServingConfig``, on the loop's thread), with ``weights``
    (model, tokenizer) if given. With ``group``, or ``tensor_parallel`` > 1 (ranks this process starts at
    the first build), the engine is sharded: on rank 0 it is a ``mirror.LeadEngine``, and the other ranks
    are told to build theirs first. The disk tier is left out then (the ranks do not share one)."""

    doorbell = None  # with ranks this process starts: wakes them for each message (mirror.share)

    def build(config, weights):
        from .engine.engine import Engine
        from .parallel import mirror
        from .parallel.collectives import check_shardable
        from .models.loading import load_model, resolve_model_path

        nonlocal group, doorbell
        try:
            folder = resolve_model_path(fetch())
            sharded = group is not None or tensor_parallel > 1
            model, tokenizer = weights or load_model(str(folder), lazy=sharded)  # lazy: each rank reads its shard
            if group is None and sharded:
                check_shardable(model, tensor_parallel)  # before any other rank starts
                group, doorbell = ranks.lead(tensor_parallel, str(folder), model_id, follower=__name__)
            lead = group is not None and group.rank() == 0
            if lead:
                mirror.announce_build(config, group, doorbell)
            draft_model, options = None, config.engine
            if config.draft_model is not None:  # its id, folder or repo
                draft_model, _ = load_model(str(resolve_model_path(model_source(config.draft_model))))
            quantization = (options.kv_bits, options.kv_group_size) if options.kv_bits else None
            disk = None
            if config.kv_disk_budget and options.enable_prefix_caching and group is None:
                disk = disk_cache(folder, config.kv_disk_budget, quantization)
            engine = Engine(model, tokenizer, options, kv_disk_cache=disk, verdict_file=plugin_dir() / "verdicts.json",
                            tensor_parallel=group, draft_model=draft_model)  # fmt: skip
        except (ValueError, RuntimeError, OSError) as e:  # ModelFetchError is a RuntimeError
            raise ModelLoadError(f"{model_id}: {one_line(e)}") from None
        return mirror.LeadEngine(engine, group, on_group_failure, doorbell) if lead else engine

    return build


def disk_cache(folder: Path, budget: int, kv_quantization=None):
    """The disk tier for a model folder, keyed by the folder, its files' content, how it was loaded and how
    K/V are stored (``kv_quantization``: None, or bits and group size)."""
    import mlx.core as mx

    from .engine.disk.store import KVDiskCache
    from .models.identity import model_identity

    on_cpu = mx.default_device() == mx.cpu
    digests = plugin_dir() / "weight-digests.json"  # so a model's weights are hashed once, not at every start
    settings = {"dequantized": on_cpu, "dtype": "float32" if on_cpu else "as-stored"}
    if kv_quantization is not None:  # only quantized K/V add to the identity: full-precision files keep theirs
        settings["kv_bits"], settings["kv_group_size"] = kv_quantization
    identity = model_identity(folder, digests, **settings)
    key = (kv_disk_dir(), identity, budget)
    if key not in _DISK_CACHES:
        _DISK_CACHES[key] = KVDiskCache(*key, close_at_exit=False)  # closed once every loop has stopped
    return _DISK_CACHES[key]


def _close_disk_caches() -> None:
    """Once no loop can write to them any more (a request's end may queue writes), close the disk tiers."""
    with _LOOPS_LOCK:
        if not all(loop.parked.is_set() for loop in _LOOPS.values()):
            return
        caches = list(_DISK_CACHES.values())
        _DISK_CACHES.clear()
    for cache in caches:
        cache.close()


if __name__ == "__main__":
    import sys

    folder, model_id, backend, size, lead_pid = sys.argv[1:6]
    ranks.follow(backend, int(size), int(lead_pid), lambda group: engine_builder(model_id, lambda: folder, group))
