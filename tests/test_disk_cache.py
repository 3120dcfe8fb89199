"""The disk tier of the prefix cache: same tokens from disk as computed, across restarts; bad files, failing
reads and writes and a dead writer cost only recomputation; each model's budget evicts its least recently used
files; the model id comes from the weights' content."""

import atexit
import contextlib
import errno
import gc
import json
import os
import socket
import subprocess
import sys
import threading
import time
import tracemalloc
import warnings
import weakref
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from models import tiny_model
from safetensors.numpy import load as load_safetensors
from safetensors.numpy import save as save_safetensors
from test_engine import random_prompts, reference

from llm_paged_mlx import Engine, SamplingParams
from llm_paged_mlx import files
from llm_paged_mlx.engine.disk import admin
from llm_paged_mlx.engine.disk import store as store_module
from llm_paged_mlx.engine.disk.admin import clear_directory, directory_info
from llm_paged_mlx.engine.disk.store import KVDiskCache, KVDiskCacheWarning
from llm_paged_mlx.engine.block_manager import chain_hash
from llm_paged_mlx.engine.loop import EngineLoop
from llm_paged_mlx.models import identity
from llm_paged_mlx.models.identity import model_identity

BLOCK = 16
GREEDY = SamplingParams(max_tokens=12)


@contextlib.contextmanager
def caught():
    """Every KVDiskCacheWarning raised inside, also from the writer thread."""
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        yield seen
    seen[:] = [w for w in seen if issubclass(w.category, KVDiskCacheWarning)]


def cached_engine(model, directory, model_id="tiny", **options):
    return Engine(model, num_blocks=64, kv_disk_cache=KVDiskCache(directory, model_id), **options)


def first_turn(model, directory, prompt, model_id="tiny"):
    """Serve ``prompt`` with a disk tier over ``directory`` and wait for its blocks to be written."""
    engine = cached_engine(model, directory, model_id)
    answer = engine.generate([prompt], GREEDY)[0].token_ids
    engine.disk.flush()
    return answer


def block_path(directory, prompt, index, model_id="tiny"):
    """The file of the prompt's block ``index``."""
    digest = None
    for i in range(index + 1):
        digest = chain_hash(digest, prompt[i * BLOCK : (i + 1) * BLOCK])
    return Path(directory) / KVDiskCache(directory, model_id)._path(digest).name


def conversation(seed=3):
    """A first prompt and the new turn of its follow-up."""
    return random_prompts([100], seed=seed)[0], random_prompts([20], seed=seed + 1)[0]


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_follow_up_is_the_same_with_prefix_cache_off_on_and_from_disk_after_restart(arch, tmp_path):
    model = tiny_model(arch)
    prompt, new_turn = conversation()

    off = Engine(model, num_blocks=64, enable_prefix_caching=False)
    answer = off.generate([prompt], GREEDY)[0].token_ids
    follow_up = prompt + answer + new_turn
    expected = off.generate([follow_up], GREEDY)[0].token_ids
    assert answer == reference(model, prompt, 12) and expected == reference(model, follow_up, 12)
    reusable = (len(prompt) + len(answer) - 1) // BLOCK * BLOCK  # the first turn's computed full blocks

    on = Engine(model, num_blocks=64)
    assert on.generate([prompt], GREEDY)[0].token_ids == answer
    out = on.generate([follow_up], GREEDY)[0]
    assert out.token_ids == expected
    assert out.num_cached_tokens == on.stats()["prefix_cache_hit_tokens"] == reusable
    assert out.num_disk_cached_tokens == 0

    assert first_turn(model, tmp_path, prompt) == answer
    restarted = cached_engine(model, tmp_path)  # a new engine and a new cache over the same folder
    out = restarted.generate([follow_up], GREEDY)[0]
    assert out.token_ids == expected
    assert out.num_cached_tokens == out.num_disk_cached_tokens == reusable
    assert restarted.stats()["disk_cache_hit_tokens"] == reusable
    assert restarted.stats()["prefix_cache_hit_tokens"] == 0
    assert restarted.disk.info()["hits"] == reusable // BLOCK


def test_a_new_process_reads_the_blocks(tmp_path):
    model = tiny_model("llama")
    prompt, new_turn = conversation(seed=5)
    answer = first_turn(model, tmp_path, prompt)
    follow_up = prompt + answer + new_turn
    child = f"""
import json, sys
sys.path.insert(0, {str(Path(__file__).parent)!r})
from models import tiny_model
from llm_paged_mlx import Engine, SamplingParams
from llm_paged_mlx.engine.disk.store import KVDiskCache
engine = Engine(tiny_model("llama"), num_blocks=64, kv_disk_cache=KVDiskCache({str(tmp_path)!r}, "tiny"))
out = engine.generate([json.loads(sys.argv[1])], SamplingParams(max_tokens=12))[0]
print(json.dumps([out.token_ids, out.num_disk_cached_tokens]))
"""  # and it exits without a flush: its own blocks are written at exit
    command = [sys.executable, "-c", child, json.dumps(follow_up)]
    run = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    tokens, from_disk = json.loads(run.stdout)
    assert tokens == reference(model, follow_up, 12)
    assert from_disk == (len(prompt) + len(answer) - 1) // BLOCK * BLOCK
    assert KVDiskCache(tmp_path, "tiny").info()["blocks"] == (len(follow_up) + 12 - 1) // BLOCK


def test_bfloat16_blocks_round_trip(tmp_path):
    model = tiny_model("qwen2")
    model.set_dtype(mx.bfloat16)
    prompt, new_turn = conversation(seed=7)
    in_memory = Engine(model, num_blocks=64)
    answer = in_memory.generate([prompt], GREEDY)[0].token_ids
    follow_up = prompt + answer + new_turn
    expected = in_memory.generate([follow_up], GREEDY)[0]
    assert first_turn(model, tmp_path, prompt, "tiny-bf16") == answer
    out = cached_engine(model, tmp_path, "tiny-bf16").generate([follow_up], GREEDY)[0]
    assert out.token_ids == expected.token_ids
    assert out.num_disk_cached_tokens == expected.num_cached_tokens > 0


def test_an_aborted_prefill_keeps_its_computed_blocks(tmp_path):
    model = tiny_model("llama")
    prompt = random_prompts([100], seed=11)[0]
    engine = cached_engine(model, tmp_path, max_num_batched_tokens=32)
    rid = engine.add_request(prompt, GREEDY)
    engine.step()
    engine.step()
    engine.abort(rid)  # 64 of the 100 tokens were computed
    engine.disk.flush()
    assert engine.disk.info()["blocks"] == 4
    out = cached_engine(model, tmp_path).generate([prompt], GREEDY)[0]
    assert out.token_ids == reference(model, prompt, 12)
    assert out.num_disk_cached_tokens == 64


def _rewrite(path: Path, **meta_changes):
    arrays = load_safetensors(path.read_bytes())
    with open(path, "rb") as file:
        meta = json.loads(file.read(int.from_bytes(file.read(8), "little")))["__metadata__"]
    path.write_bytes(save_safetensors(arrays, metadata={**meta, **meta_changes}))


def _write_header(path: Path, header, length=None, data=b""):
    """Make ``path`` a file of ``header`` (JSON, or raw bytes) declaring ``length`` bytes of header."""
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes((len(raw) if length is None else length).to_bytes(8, "little") + raw + data)


def _flip_last_byte(path: Path):
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))


DAMAGE = {
    "corrupt": _flip_last_byte,
    "truncated": lambda path: path.write_bytes(path.read_bytes()[: path.stat().st_size // 2]),
    "not safetensors": lambda path: path.write_bytes(b"\x00" * 40),
    "foreign model": lambda path: _rewrite(path, model_id="another model"),
    "wrong version": lambda path: _rewrite(path, version="0"),
    "metadata not an object": lambda path: _write_header(path, {"__metadata__": "a string"}),
}


@pytest.mark.parametrize("damage", DAMAGE)
def test_a_bad_file_is_removed_with_one_warning_and_recomputed(damage, tmp_path):
    model = tiny_model("llama")
    prompt, new_turn = conversation()
    answer = first_turn(model, tmp_path, prompt)
    follow_up = prompt + answer + new_turn
    bad = block_path(tmp_path, prompt, 2)
    DAMAGE[damage](bad)
    damaged = bad.read_bytes()
    with caught() as seen:
        disk = _recording_layout(KVDiskCache(tmp_path, "tiny"))
        engine = Engine(model, num_blocks=64, kv_disk_cache=disk)
        out = engine.generate([follow_up], GREEDY)[0]
        engine.disk.flush()
    assert out.token_ids == reference(model, follow_up, 12)
    assert out.num_disk_cached_tokens == 2 * BLOCK  # the blocks before the bad one
    assert len(seen) == 1 and bad.name in str(seen[0].message)
    assert bad.read_bytes() != damaged  # removed, then written again from the recomputed K/V
    blocks = [prompt[i * BLOCK : (i + 1) * BLOCK] for i in range(3)]
    assert len(KVDiskCache(tmp_path, "tiny").load_chain(None, blocks, disk.layout)) == 3


def _recording_layout(cache: KVDiskCache) -> KVDiskCache:
    """``cache``, keeping in ``cache.layout`` the layout that the engine looks blocks up with."""
    lookup = cache.load_chain

    def load_chain(parent, blocks, layout):
        cache.layout = layout
        return lookup(parent, blocks, layout)

    cache.load_chain = load_chain
    return cache


def test_a_failing_write_warns_once_leaves_nothing_and_turns_writing_off(tmp_path, monkeypatch):
    def disk_full(file, payload):
        file.write(payload[: len(payload) // 2])
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(files, "_write_all", disk_full)
    model = tiny_model("llama")
    prompt = random_prompts([100], seed=13)[0]
    with caught() as seen:
        engine = cached_engine(model, tmp_path)
        out = engine.generate([prompt], GREEDY)[0]
        engine.disk.flush()
    assert out.token_ids == reference(model, prompt, 12)
    assert len(seen) == 1 and "No space left" in str(seen[0].message)
    assert list(tmp_path.iterdir()) == []
    assert (engine.disk.info()["write_errors"], engine.disk.skipped_writes) == (1, 5)  # the rest were not tried
    monkeypatch.undo()
    with caught() as seen:
        assert engine.generate([prompt], GREEDY)[0].token_ids == out.token_ids
        engine.disk.flush()
    assert seen == [] and list(tmp_path.iterdir()) == []  # off for the rest of the process


# -- a folder that cannot be written: writing off with one warning, every request served ---------

WRITING = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
FOLDER_ERRORS = [errno.EROFS, errno.ENOSPC, errno.EDQUOT, errno.EACCES, errno.EPERM]


def unwritable(monkeypatch, directory, error=errno.EROFS):
    """Fail every change under ``directory`` with ``error``, as a read-only, full or another user's folder does
    (as root, chmod stops nothing); reading still works."""
    inside = str(directory)

    def refuse(name, changes=lambda *args: True):
        real = getattr(os, name)

        def call(path, *args, **kwargs):
            if os.fspath(path).startswith(inside) and changes(*args):
                raise OSError(error, os.strerror(error), os.fspath(path))
            return real(path, *args, **kwargs)

        monkeypatch.setattr(os, name, call)

    refuse("open", lambda flags, *mode: flags & WRITING)
    for name in ("utime", "unlink", "replace", "rename", "mkdir", "rmdir"):
        refuse(name)


def snapshot(directory):
    """Every file's name, content and mtime."""
    return {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in Path(directory).iterdir()}


@pytest.mark.parametrize("error", FOLDER_ERRORS, ids=errno.errorcode.get)
def test_an_unwritable_folder_turns_writing_off_with_one_warning_and_fails_no_request(error, tmp_path, monkeypatch):
    """A hit's mtime refresh (os.utime) raised out of the lookup: every step failed, the request without a
    disk hit in it too."""
    model = tiny_model("llama")
    prompt, new_turn = conversation()
    follow_up = prompt + first_turn(model, tmp_path, prompt) + new_turn
    other = random_prompts([60], seed=21)[0]  # nothing of it on disk
    before = snapshot(tmp_path)
    unwritable(monkeypatch, tmp_path, error)
    with caught() as seen:
        engine = cached_engine(model, tmp_path)
        hit, miss = engine.generate([follow_up, other], GREEDY)
        engine.disk.flush()
    assert hit.token_ids == reference(model, follow_up, 12) and miss.token_ids == reference(model, other, 12)
    assert hit.num_disk_cached_tokens == 6 * BLOCK and miss.num_disk_cached_tokens == 0  # the blocks are still read
    assert engine.blocks.num_free_blocks == engine.blocks.num_usable_blocks  # none leaked
    assert len(seen) == 1 and os.strerror(error) in str(seen[0].message)
    assert "writes nothing more" in str(seen[0].message) and str(tmp_path) in str(seen[0].message)
    with caught() as seen:
        assert engine.generate([other], GREEDY)[0].token_ids == miss.token_ids
        engine.disk.close()
    assert seen == [] and engine.disk.info()["writes"] == 0
    assert snapshot(tmp_path) == before  # nothing written, touched, removed or half-written


def test_an_unwritable_folder_fails_no_request_of_an_engine_loop(tmp_path, monkeypatch):
    """The way llm and the server run the engine: both requests ended in StepFailed."""
    model = tiny_model("llama")
    prompt, new_turn = conversation(seed=23)
    follow_up = prompt + first_turn(model, tmp_path, prompt) + new_turn
    other = random_prompts([60], seed=25)[0]
    unwritable(monkeypatch, tmp_path)
    built = []

    def build(config, weights):
        built.append(cached_engine(model, tmp_path))
        return built[-1]

    loop = EngineLoop(build)
    with caught() as seen:
        submissions = [loop.submit(tokens, GREEDY) for tokens in (follow_up, other)]
        answers = [[t for chunk in submission for t in chunk.token_ids] for submission in submissions]
        loop.stop()
    assert answers == [reference(model, follow_up, 12), reference(model, other, 12)]
    assert built[0].stats()["disk_cache_hit_tokens"] > 0 and built[0].stats()["used_blocks"] == 0
    assert len(seen) == 1 and "Read-only file system" in str(seen[0].message)


def test_a_folder_that_cannot_be_made_turns_writing_off_not_the_engine(tmp_path, monkeypatch):
    """The cache made its folder in its constructor: the error failed the model's loading."""
    unwritable(monkeypatch, tmp_path)
    model = tiny_model("llama")
    prompt = random_prompts([40], seed=27)[0]
    with caught() as seen:
        engine = cached_engine(model, tmp_path / "kv-cache")
        assert engine.generate([prompt], GREEDY)[0].token_ids == reference(model, prompt, 12)
        engine.disk.flush()
    assert len(seen) == 1 and "could not make the folder" in str(seen[0].message)
    assert list(tmp_path.iterdir()) == []


def test_a_bad_file_in_an_unwritable_folder_is_kept_and_recomputed(tmp_path, monkeypatch):
    """Its removal failed unnoticed, and the warning said it was removed."""
    cache, path = _stored_file(tmp_path)
    _flip_last_byte(path)
    damaged = path.read_bytes()
    unwritable(monkeypatch, tmp_path)
    with caught() as seen:
        assert cache.load_chain(None, [list(range(BLOCK))], LAYOUT) == []
    off, bad = (str(w.message) for w in seen)  # writing turned off, then the file's own warning
    assert f"could not remove {path.name}" in off and "Read-only file system" in off
    assert "checksum" in bad and "kept it" in bad and path.read_bytes() == damaged


def test_files_are_private(tmp_path):
    first_turn(tiny_model("llama"), tmp_path / "kv", random_prompts([40])[0])
    assert (tmp_path / "kv").stat().st_mode & 0o777 == 0o700
    files = list((tmp_path / "kv").iterdir())  # the blocks and the lock file
    assert len(admin.block_files(tmp_path / "kv")) == 3 and len(files) == 4
    assert all(f.stat().st_mode & 0o777 == 0o600 for f in files)


# -- the cache on its own: eviction, info, clear --------------------------------------

LAYOUT = [(f"{kv}.{layer}", (2 * BLOCK, 8), mx.float32) for layer in range(2) for kv in "kv"]  # 2 heads of dim 8
NAMES = [name for name, _, _ in LAYOUT]


def fake_blocks(seed):
    """A ``read_blocks`` that returns random K/V, and what it returned."""
    given = []

    def read_blocks(ids):
        rng = np.random.default_rng(seed)
        given[:] = [mx.array(rng.standard_normal((len(ids) * 2 * BLOCK, 8)).astype(np.float32)) for _ in LAYOUT]
        return given

    return read_blocks, given


def store(cache, tokens, seed=0):
    read_blocks, given = fake_blocks(seed)
    cache.save(tokens, list(range(len(tokens) // BLOCK)), BLOCK, read_blocks, NAMES)
    cache.flush()
    return given


def test_loaded_blocks_equal_saved_ones(tmp_path):
    cache = KVDiskCache(tmp_path, "fake")
    tokens = list(range(3 * BLOCK))
    given = store(cache, tokens)
    found = KVDiskCache(tmp_path, "fake").load_chain(None, [tokens[i : i + BLOCK] for i in range(0, 48, BLOCK)], LAYOUT)
    assert len(found) == 3
    for index, block in enumerate(found):
        for array, saved in zip(block, given):
            assert mx.array_equal(array, saved[index * 2 * BLOCK : (index + 1) * 2 * BLOCK])
    assert store(cache, tokens) == [] and cache.info()["writes"] == 3  # nothing is written twice


def test_blocks_beyond_the_pending_cap_are_skipped_not_waited_for(tmp_path, monkeypatch):
    release = threading.Event()
    real_write = files._write_all
    monkeypatch.setattr(files, "_write_all", lambda file, payload: release.wait() and real_write(file, payload))
    block_bytes = 4 * 2 * BLOCK * 8 * 4  # LAYOUT in float32
    cache = KVDiskCache(tmp_path, "fake", max_pending_bytes=int(1.5 * block_bytes))
    read_blocks, _ = fake_blocks(0)
    assert cache.save(list(range(3 * BLOCK)), [1, 2, 3], BLOCK, read_blocks, NAMES) == 1
    release.set()
    assert cache.info()["blocks"] == 1 and cache.skipped_writes == 2


def test_budget_evicts_the_least_recently_used(tmp_path):
    sequences = [list(range(s * BLOCK, (s + 1) * BLOCK)) for s in range(4)]  # A, B, C, D: one block each
    probe = KVDiskCache(tmp_path / "probe", "fake")
    store(probe, sequences[0])
    file_size = probe.info()["size_bytes"]
    cache = KVDiskCache(tmp_path / "kv", "fake", budget_bytes=int(3.5 * file_size))
    for tokens in sequences[:3]:
        store(cache, tokens)
    assert cache.load_chain(None, [sequences[0]], LAYOUT)  # A is used again, so B is now the oldest
    store(cache, sequences[3])
    kept = [bool(cache.load_chain(None, [tokens], LAYOUT)) for tokens in sequences]
    assert kept == [True, False, True, True]
    assert cache.info()["size_bytes"] <= cache.budget_bytes


def test_eviction_takes_a_chain_tail_first(tmp_path):
    probe = KVDiskCache(tmp_path / "probe", "fake")
    store(probe, list(range(BLOCK)))
    cache = KVDiskCache(tmp_path / "kv", "fake", budget_bytes=int(3.5 * probe.info()["size_bytes"]))
    tokens = list(range(5 * BLOCK))
    store(cache, tokens)
    found = cache.load_chain(None, [tokens[i : i + BLOCK] for i in range(0, len(tokens), BLOCK)], LAYOUT)
    assert len(found) == 3 == cache.info()["blocks"]


def test_info_counts_per_model_and_clear_removes_all(tmp_path):
    first, second = KVDiskCache(tmp_path, "model one"), KVDiskCache(tmp_path, "model two")
    store(first, list(range(2 * BLOCK)))
    store(second, list(range(3 * BLOCK)))
    assert first.load_chain(None, [list(range(BLOCK)), list(range(100, 100 + BLOCK))], LAYOUT)
    info = first.info()
    assert {name: m["blocks"] for name, m in info["models"].items()} == {"model one": 2, "model two": 3}
    assert info["blocks"] == 5 and info["size_bytes"] == sum(f.stat().st_size for f in tmp_path.iterdir())
    assert (info["hits"], info["misses"], info["writes"]) == (1, 1, 2)
    assert directory_info(tmp_path)["models"] == info["models"]
    assert first.clear() == 5
    assert [f.name for f in tmp_path.iterdir()] == [admin.LOCK_FILE] and second.info()["blocks"] == 0
    assert clear_directory(tmp_path / "missing") == 0 == directory_info(tmp_path / "missing")["blocks"]


def test_a_dead_writer_s_old_temporary_file_is_swept(tmp_path):
    old, recent = tmp_path / ".tmp-old.part", tmp_path / ".tmp-recent.part"
    old.write_bytes(b"half a block")
    recent.write_bytes(b"being written")
    os.utime(old, (0, 0))
    KVDiskCache(tmp_path, "fake")
    assert not old.exists() and recent.exists()


def test_model_identity_changes_with_the_weights_and_settings(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    (tmp_path / "model.safetensors").write_bytes(b"weights")
    digests = tmp_path / "digests.json"
    base = model_identity(tmp_path, digests, dtype="float32")
    assert base == model_identity(tmp_path, digests, dtype="float32")
    assert base != model_identity(tmp_path, digests, dtype="float16")
    (tmp_path / "model.safetensors").write_bytes(b"other weights")
    assert model_identity(tmp_path, digests, dtype="float32") != base


def _same_size_same_mtime(path: Path, content: bytes, in_place: bool):
    """Put ``content`` (as long as the old) in ``path`` and give it back its mtime, as a careless copy would."""
    old = path.stat()
    time.sleep(0.05)  # past the kernel's timestamp granularity, so that the write moves the file's ctime
    if in_place:
        path.write_bytes(content)
    else:
        path.with_suffix(".new").write_bytes(content)
        os.replace(path.with_suffix(".new"), path)
    os.utime(path, ns=(old.st_atime_ns, old.st_mtime_ns))
    assert path.stat().st_size == old.st_size and path.stat().st_mtime_ns == old.st_mtime_ns


@pytest.mark.parametrize("in_place", [True, False], ids=["rewritten in place", "replaced"])
def test_model_identity_is_the_weights_content_not_their_size_and_mtime(tmp_path, monkeypatch, in_place):
    folder, digests = tmp_path / "model", tmp_path / "plugin" / "digests.json"
    folder.mkdir()
    (folder / "config.json").write_text('{"model_type": "llama"}')
    weights = folder / "model-00001-of-00001.safetensors"
    weights.write_bytes(b"weights 1")
    hashed = []
    real_digest = identity.file_digest
    monkeypatch.setattr(identity, "file_digest", lambda path: hashed.append(path) or real_digest(path))
    base = model_identity(folder, digests)
    assert model_identity(folder, digests) == base and len(hashed) == 1  # hashed once, then from the cache file
    assert json.loads(digests.read_text())[str(weights)]["blake2b"] == real_digest(weights)
    _same_size_same_mtime(weights, b"weights 2", in_place)
    assert model_identity(folder, digests) != base and len(hashed) == 2
    digests.write_text("[not, json")  # a damaged cache file costs a hash, not an error
    assert model_identity(folder, digests) == model_identity(folder, digests) != base and len(hashed) == 3


def test_the_digest_cache_is_written_whole_or_not_at_all(tmp_path, monkeypatch):
    """identity wrote it with its own copy of an atomic write, which did not sync; now files.write_atomically."""
    def disk_full(file, payload):
        file.write(payload[: len(payload) // 2])
        raise OSError(errno.ENOSPC, "No space left on device")

    folder, digests = tmp_path / "model", tmp_path / "plugin" / "digests.json"
    folder.mkdir()
    (folder / "config.json").write_text('{"model_type": "llama"}')
    (folder / "model.safetensors").write_bytes(b"weights")
    expected = model_identity(folder, tmp_path / "elsewhere.json")
    monkeypatch.setattr(files, "_write_all", disk_full)
    assert model_identity(folder, digests) == expected  # a cache that cannot be written costs a hash next time
    assert list(digests.parent.iterdir()) == []
    monkeypatch.undo()
    assert model_identity(folder, digests) == expected and digests.is_file()


def test_a_weight_file_is_hashed_in_chunks_not_read_whole(tmp_path):
    weights = tmp_path / "model.safetensors"
    with open(weights, "wb") as file:
        file.truncate(64 * 1024**2)  # sparse: 64 MB to read, nothing to write
    tracemalloc.start()
    try:
        identity.file_digest(weights)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 4 * identity.CHUNK


def test_the_disk_tier_needs_the_prefix_cache(tmp_path):
    with pytest.raises(ValueError, match="needs enable_prefix_caching"):
        Engine(tiny_model("llama"), num_blocks=8, enable_prefix_caching=False, kv_disk_cache=KVDiskCache(tmp_path, "x"))


# -- bad files, failing reads, a dead writer, full blocks only -------------------------


def _stored_file(directory, model_id="fake", tokens=tuple(range(BLOCK))):
    """A cache over ``directory`` that saved one block of ``tokens``, and that block's file."""
    cache = KVDiskCache(directory, model_id)
    store(cache, list(tokens))
    return cache, cache._path(chain_hash(None, list(tokens)))


def _reshaped(path: Path, name: str, change):
    """Rewrite the block file with ``change`` applied to its tensor ``name``, the metadata kept."""
    arrays = load_safetensors(path.read_bytes())
    with open(path, "rb") as file:
        meta = json.loads(file.read(int.from_bytes(file.read(8), "little")))["__metadata__"]
    arrays[name] = change(arrays[name])
    path.write_bytes(save_safetensors(arrays, metadata=meta))


def _tensor_entry(path: Path, name: str, **changes):
    """Rewrite one tensor's header entry in place, the data kept."""
    data = path.read_bytes()
    length = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + length])
    header[name] = changes.pop("whole", None) or {**header[name], **changes}
    _write_header(path, header, data=data[8 + length :])


MALFORMED = {  # damage, and a word the warning's reason must say
    "metadata a string": (lambda p: _write_header(p, {"__metadata__": "a string"}), "metadata"),
    "metadata a list": (lambda p: _write_header(p, {"__metadata__": ["format"]}), "metadata"),
    "header a list": (lambda p: _write_header(p, [1, 2]), "header"),
    "header length 2**64-1": (lambda p: _write_header(p, {}, length=2**64 - 1), "header"),
    "header length 2**40": (lambda p: _write_header(p, {}, length=2**40), "header"),
    "header deeper than the parser": (lambda p: _write_header(p, b"[" * 100_000), "JSON"),
    "header not UTF-8": (lambda p: _write_header(p, b"\xff\xfe{}"), "JSON"),
    "empty": (lambda p: p.write_bytes(b""), "too short"),
    "tensor entry a string": (lambda p: _tensor_entry(p, "k.0", whole="F32"), "k.0"),
    "offsets outside the data": (lambda p: _tensor_entry(p, "v.1", data_offsets=[0, 10**12]), "outside"),
    "offsets not numbers": (lambda p: _tensor_entry(p, "v.0", data_offsets="0-4096"), "outside"),
    "wrong dtype": (lambda p: _reshaped(p, "k.1", lambda a: a.astype(np.float16)), "k.1"),
    "wrong shape": (lambda p: _reshaped(p, "v.0", lambda a: a[:-1]), "v.0"),
    "a tensor missing": (lambda p: _reshaped(p, "token_ids", lambda a: a[:0]), "token_ids"),
    "other tokens": (lambda p: _reshaped(p, "token_ids", lambda a: a[::-1].copy()), "other tokens"),
}


@pytest.mark.parametrize("damage", MALFORMED)
def test_every_malformed_file_is_removed_with_a_warning_that_names_it(damage, tmp_path):
    cache, path = _stored_file(tmp_path)
    spoil, reason = MALFORMED[damage]
    spoil(path)
    with caught() as seen:
        assert cache.load_chain(None, [list(range(BLOCK))], LAYOUT) == []
    assert len(seen) == 1 and path.name in str(seen[0].message) and reason in str(seen[0].message)
    assert not path.exists()
    assert store(cache, list(range(BLOCK))) and len(cache.load_chain(None, [list(range(BLOCK))], LAYOUT)) == 1


@pytest.mark.parametrize("error", [errno.EMFILE, errno.EACCES, errno.EIO])
def test_a_read_error_is_a_miss_that_keeps_the_file(error, tmp_path, monkeypatch):
    cache, path = _stored_file(tmp_path)
    failures, real_open = [], os.open

    def failing_open(file, flags, *args, **kwargs):
        if os.fspath(file) == str(path) and len(failures) < fail_times:
            failures.append(file)
            raise OSError(error, os.strerror(error), str(file))
        return real_open(file, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", failing_open)
    fail_times = 1  # a passing error: tried again, found
    with caught() as seen:
        assert len(cache.load_chain(None, [list(range(BLOCK))], LAYOUT)) == 1
    assert seen == [] and len(failures) == 1
    failures.clear()
    fail_times = 2 * store_module.READ_ATTEMPTS  # an error that lasts two lookups: two misses
    with caught() as seen:
        assert cache.load_chain(None, [list(range(BLOCK))], LAYOUT) == []
        assert cache.load_chain(None, [list(range(BLOCK))], LAYOUT) == []
    assert len(seen) == 1 and path.name in str(seen[0].message) and os.strerror(error) in str(seen[0].message)
    assert path.exists() and cache.info()["read_errors"] == 2
    assert len(cache.load_chain(None, [list(range(BLOCK))], LAYOUT)) == 1  # the error passed: the file is good


def _unix_socket(path: Path):
    server = socket.socket(socket.AF_UNIX)
    server.bind(path.name)  # relative: a socket's path is short, the test's folder may not be
    server.close()


NOT_A_BLOCK_FILE = {  # what takes a block file's place (given the file and a folder outside), and the warning's word
    "FIFO": (lambda path, outside: os.mkfifo(path), "FIFO"),
    "socket": (lambda path, outside: _unix_socket(path), "socket"),
    "directory": (lambda path, outside: (path.mkdir(), (path / "x").write_text("x"),
                                         (path / "link").symlink_to(outside / "keep.txt")), "directory"),
    "symlink to /dev/zero": (lambda path, outside: path.symlink_to("/dev/zero"), "symbolic link"),
    "symlink to a good block file": (lambda path, outside: path.symlink_to(outside / "block"), "symbolic link"),
    "sparse 1 GiB file": (lambda path, outside: os.truncate(path.with_name("big"), 1 << 30)
                          or os.replace(path.with_name("big"), path), "1073741824 bytes, larger"),
}


@pytest.mark.parametrize("kind", NOT_A_BLOCK_FILE)
def test_what_is_not_a_block_file_is_removed_never_followed_read_whole_or_waited_on(kind, tmp_path, monkeypatch):
    """A FIFO hung the lookup, a symlink to /dev/zero or a sparse huge file used all memory, a directory or a
    socket failed every read and stayed forever, a symlink was followed."""
    cache, path = _stored_file(tmp_path / "kv")
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep.txt").write_text("mine")
    os.replace(path, outside / "block")  # a good block file, for the symlink to point to
    (tmp_path / "kv" / "big").touch()
    monkeypatch.chdir(tmp_path / "kv")
    make, word = NOT_A_BLOCK_FILE[kind]
    make(path, outside)
    found = []
    with caught() as seen:
        tracemalloc.start()
        try:
            lookup = threading.Thread(target=lambda: found.append(cache.load_chain(None, [list(range(BLOCK))], LAYOUT)),
                                      daemon=True)
            lookup.start()
            lookup.join(120)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
    assert not lookup.is_alive(), "the lookup hangs"
    assert found == [[]] and peak < 64 * 1024**2
    assert len(seen) == 1 and path.name in str(seen[0].message) and word in str(seen[0].message)
    assert not os.path.lexists(path)
    assert (outside / "keep.txt").read_text() == "mine" and (outside / "block").is_file()  # no link followed
    assert store(cache, list(range(BLOCK))) and len(cache.load_chain(None, [list(range(BLOCK))], LAYOUT)) == 1


@pytest.mark.parametrize("kind", ["FIFO", "symlink to a good block file"])
def test_save_replaces_what_is_not_a_block_file(kind, tmp_path):
    """save took anything that ``exists()`` for the block on disk, so that block was never written."""
    cache, path = _stored_file(tmp_path / "kv")
    (tmp_path / "outside").mkdir()
    os.replace(path, tmp_path / "outside" / "block")
    NOT_A_BLOCK_FILE[kind][0](path, tmp_path / "outside")
    assert store(cache, list(range(BLOCK))) and path.is_file() and not path.is_symlink()
    assert (tmp_path / "outside" / "block").is_file()
    with caught() as seen:
        assert len(cache.load_chain(None, [list(range(BLOCK))], LAYOUT)) == 1
    assert seen == []


class WriterKilled(BaseException):
    """Not an Exception: nothing in the writer handles it, so its thread dies."""


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_dead_writer_neither_hangs_flush_nor_close_and_later_saves_are_skipped(tmp_path, monkeypatch):
    started, die = threading.Event(), threading.Event()

    def killed(file, payload):
        started.set()
        die.wait()
        raise WriterKilled()

    monkeypatch.setattr(files, "_write_all", killed)
    cache, other = KVDiskCache(tmp_path, "fake"), KVDiskCache(tmp_path, "another model")
    read_blocks, _ = fake_blocks(0)
    assert cache.save(list(range(3 * BLOCK)), [1, 2, 3], BLOCK, read_blocks, NAMES) == 3
    started.wait(120)
    die.set()
    with caught() as seen:
        for wait in (cache.flush, cache.close, other.flush, other.close):  # atexit calls close
            waiter = threading.Thread(target=wait, daemon=True)
            waiter.start()
            waiter.join(120)
            assert not waiter.is_alive(), f"{wait.__name__} hangs on a dead writer"
    assert len(seen) == 1 and "WriterKilled" in str(seen[0].message)
    assert "3 blocks were not written" in str(seen[0].message)
    assert cache.info()["dropped_writes"] == 3 and cache._pending_bytes == 0
    monkeypatch.undo()
    assert other.save(list(range(BLOCK)), [1], BLOCK, read_blocks, NAMES) == 0 and other.skipped_writes == 1
    assert admin.block_files(tmp_path) == [] and [p.name for p in tmp_path.glob(files.TEMP_PREFIX + "*")] == []


def test_one_writer_thread_per_directory_for_every_cache_on_it(tmp_path):
    def writers():
        return [t for t in threading.enumerate() if t.name.startswith("kv-disk-cache")]

    before = len(writers())
    same_directory = os.path.join(tmp_path, "..", tmp_path.name)  # spelled otherwise
    caches = [KVDiskCache(tmp_path, "model one"), KVDiskCache(tmp_path, "model two"),
              KVDiskCache(same_directory, "model one", budget_bytes=1 << 20)]
    for seed, cache in enumerate(caches):
        store(cache, list(range(seed * BLOCK, (seed + 2) * BLOCK)), seed)
    assert len(writers()) - before == 1
    assert [cache.info()["writes"] for cache in caches] == [2, 2, 2]


def test_save_writes_only_blocks_the_tokens_fill(tmp_path):
    cache = KVDiskCache(tmp_path, "fake")
    read_blocks, _ = fake_blocks(0)
    assert cache.save(list(range(BLOCK - 1)), [1], BLOCK, read_blocks, NAMES) == 0
    assert cache.save(list(range(2 * BLOCK - 1)), [1, 2], BLOCK, read_blocks, NAMES) == 1  # a table one block too long
    cache.flush()
    assert cache.info()["blocks"] == 1
    assert cache.load_chain(None, [list(range(BLOCK)), list(range(BLOCK, 2 * BLOCK - 1))], LAYOUT)[1:] == []


# -- eviction per model, from the directory ---------------------------------------


def _block_file_size(tmp_path):
    probe = KVDiskCache(tmp_path / "probe", "fake")
    store(probe, list(range(BLOCK)))
    return probe.info()["size_bytes"]


def _blocks_of(directory):
    return {model_id: m["blocks"] for model_id, m in directory_info(directory)["models"].items()}


def test_a_model_s_budget_evicts_only_that_model_s_files(tmp_path):
    file_size = _block_file_size(tmp_path)
    big = KVDiskCache(tmp_path / "kv", "big", budget_bytes=100 * file_size)
    small = KVDiskCache(tmp_path / "kv", "small", budget_bytes=int(1.5 * file_size))
    store(big, list(range(3 * BLOCK)))
    store(small, list(range(3 * BLOCK)))
    assert _blocks_of(tmp_path / "kv") == {"big": 3, "small": 1}
    assert len(small.load_chain(None, [list(range(BLOCK))], LAYOUT)) == 1  # the chain's prefix stayed


def test_eviction_counts_the_files_that_other_processes_wrote(tmp_path):
    file_size = _block_file_size(tmp_path)
    # two caches of one model, as two processes have: each wrote only half of what the directory holds
    first, second = (KVDiskCache(tmp_path / "kv", "fake", budget_bytes=int(3.5 * file_size)) for _ in range(2))
    store(first, list(range(2 * BLOCK)))
    store(second, list(range(100, 100 + 2 * BLOCK)))
    assert directory_info(tmp_path / "kv")["blocks"] == 3


def test_eviction_waits_for_the_directory_lock(tmp_path):
    file_size = _block_file_size(tmp_path)
    cache = KVDiskCache(tmp_path / "kv", "fake", budget_bytes=int(1.5 * file_size))
    read_blocks, _ = fake_blocks(0)
    with admin.locked(tmp_path / "kv"):  # what another process evicting or clearing holds
        cache.save(list(range(3 * BLOCK)), [1, 2, 3], BLOCK, read_blocks, NAMES)
        waiter = threading.Thread(target=cache.flush, daemon=True)
        waiter.start()
        waiter.join(0.5)
        assert waiter.is_alive() and len(admin.block_files(tmp_path / "kv")) == 3
    waiter.join(120)
    assert len(admin.block_files(tmp_path / "kv")) == 1


def test_a_lock_wait_with_a_timeout_ends_in_a_timeout_error_naming_the_lock(tmp_path):
    with files.locked(tmp_path / "lock"):
        started = time.monotonic()
        with pytest.raises(TimeoutError, match=str(tmp_path / "lock")), files.locked(tmp_path / "lock", timeout=0.2):
            pass
        assert 0.2 <= time.monotonic() - started < 60  # it gave up (the upper bound only catches a hang)
    with files.locked(tmp_path / "lock", timeout=0):  # a free lock is taken at once
        pass


def _in_thread(function, timeout=120) -> bool:
    """Whether ``function`` returned within ``timeout`` seconds (bounding a hang, not measuring a speed)."""
    thread = threading.Thread(target=function, daemon=True)
    thread.start()
    thread.join(timeout)
    return not thread.is_alive()


def test_eviction_gives_up_on_a_lock_held_too_long_and_tries_again_after_the_next_writes(tmp_path, monkeypatch):
    """Eviction waited for the lock forever: with its holder suspended (Ctrl-Z), the exit's flush hung."""
    monkeypatch.setattr(admin, "LOCK_WAIT_S", 0.2)
    file_size = _block_file_size(tmp_path)
    cache = KVDiskCache(tmp_path / "kv", "fake", budget_bytes=int(1.5 * file_size))
    read_blocks, _ = fake_blocks(0)
    with caught() as seen, admin.locked(tmp_path / "kv"):  # as a suspended process would hold it
        cache.save(list(range(3 * BLOCK)), [1, 2, 3], BLOCK, read_blocks, NAMES)
        assert _in_thread(cache.flush), "flush waits for the lock"
        cache.save(list(range(100, 100 + BLOCK)), [4], BLOCK, read_blocks, NAMES)
        assert _in_thread(cache.flush), "flush waits for the lock"
        assert len(admin.block_files(tmp_path / "kv")) == 4 and cache.info()["lock_timeouts"] == 2
    assert len(seen) == 1 and admin.LOCK_FILE in str(seen[0].message) and "eviction" in str(seen[0].message)
    store(cache, list(range(200, 200 + BLOCK)))
    assert len(admin.block_files(tmp_path / "kv")) == 1


def test_hit_counts_give_up_on_a_lock_held_too_long_and_a_later_close_adds_them(tmp_path, monkeypatch):
    monkeypatch.setattr(admin, "LOCK_WAIT_S", 0.2)
    cache = KVDiskCache(tmp_path, "model-a")
    cache.hits, cache.misses = 3, 1
    with caught() as seen, admin.locked(tmp_path):
        assert _in_thread(cache.close), "close waits for the lock"
        assert _in_thread(cache.close), "close waits for the lock"
    assert len(seen) == 1 and admin.LOCK_FILE in str(seen[0].message) and "hit counts" in str(seen[0].message)
    assert "model-a" not in directory_info(tmp_path)["models"]
    cache.close()
    assert directory_info(tmp_path)["models"]["model-a"] == {"blocks": 0, "bytes": 0, "hits": 3, "misses": 1}


# -- the directory for any model: info never fails ----------------------------------


def test_info_and_clear_survive_any_file_content(tmp_path):
    _, good = _stored_file(tmp_path, "good model")
    key = "0123456789abcdef"
    bad = {
        "huge header": lambda p: _write_header(p, {}, length=2**64 - 1),
        "header past the end": lambda p: _write_header(p, {}, length=2**40),
        "metadata a string": lambda p: _write_header(p, {"__metadata__": "x"}),
        "model id a number": lambda p: _write_header(p, {"__metadata__": {"model_id": 7}}),
        "deep": lambda p: _write_header(p, b"[" * 100_000),
        "empty": lambda p: p.write_bytes(b""),
    }
    for index, spoil in enumerate(bad.values()):
        spoil(tmp_path / f"{key}-{index:064x}.safetensors")
    (tmp_path / f"{key}-dir.safetensors").mkdir()  # not a file: not a block, but clear removes it
    hits = {"good model": {"hits": 2, "misses": 1}, "odd": 5, "odder": {"hits": "x"},
             "yes": {"hits": True, "misses": 0}}
    (tmp_path / "hits.json").write_text(json.dumps(hits))
    info = directory_info(tmp_path)
    assert info["blocks"] == 1 + len(bad)
    assert info["models"] == {
        "good model": {"blocks": 1, "bytes": good.stat().st_size, "hits": 2, "misses": 1},
        key: {"blocks": len(bad), "bytes": sum(p.stat().st_size for p in tmp_path.glob(f"{key}-0*"))},
    }
    cache = KVDiskCache(tmp_path, "odd", 1 << 20)
    cache.hits = 1
    cache.close()  # over an entry that was not two counts
    assert directory_info(tmp_path)["models"]["odd"] == {"blocks": 0, "bytes": 0, "hits": 1, "misses": 0}
    assert clear_directory(tmp_path) == 2 + len(bad) and not (tmp_path / f"{key}-dir.safetensors").exists()


def test_clear_removes_whatever_has_a_block_file_s_name_and_follows_no_symlink(tmp_path):
    """clear removed regular files only: a FIFO, a directory or a symlink named as a block stayed forever."""
    _, good = _stored_file(tmp_path / "kv")
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep.txt").write_text("mine")
    names = [good.with_name(f"{'ab' * 8}-{index:032x}.safetensors") for index in range(4)]
    os.mkfifo(names[0])
    names[1].mkdir()
    (names[1] / "link").symlink_to(outside / "keep.txt")
    names[2].symlink_to("/dev/zero")
    names[3].symlink_to(outside, target_is_directory=True)
    (tmp_path / "kv" / "notes.txt").write_text("not a block")
    os.mkfifo(tmp_path / "kv" / admin.HITS_FILE)
    info = []
    assert _in_thread(lambda: info.append(directory_info(tmp_path / "kv"))), "info waits on a FIFO"
    assert info[0]["blocks"] == 1 and info[0]["models"] == {"fake": {"blocks": 1, "bytes": good.stat().st_size}}
    assert clear_directory(tmp_path / "kv") == 5
    assert sorted(p.name for p in (tmp_path / "kv").iterdir()) == [admin.LOCK_FILE, "notes.txt"]
    assert [p.name for p in outside.iterdir()] == ["keep.txt"] and (outside / "keep.txt").read_text() == "mine"


def test_the_cache_info_command_lists_a_directory_of_bad_files(tmp_path, monkeypatch):
    from click.testing import CliRunner
    from llm.cli import cli

    monkeypatch.setenv("LLM_USER_PATH", str(tmp_path))
    directory = tmp_path / "paged-mlx" / "kv-cache"
    directory.mkdir(parents=True)
    _write_header(directory / f"{'ab' * 8}-{'0' * 64}.safetensors", {}, length=2**64 - 1)
    result = CliRunner().invoke(cli, ["paged-mlx", "cache", "info"])
    assert result.exit_code == 0 and result.exception is None, result.output
    assert "1 blocks" in result.output and "abababababababab: 1 blocks" in result.output


@pytest.mark.parametrize("target_exists", [False, True], ids=["to nothing", "to a file"])
def test_a_symlink_at_the_lock_is_never_followed_and_turns_writing_off(target_exists, tmp_path, monkeypatch):
    """The lock was opened with O_CREAT and without O_NOFOLLOW: a link there made llm create its target."""
    from click.testing import CliRunner
    from llm.cli import cli

    monkeypatch.setenv("LLM_USER_PATH", str(tmp_path))
    directory, target = tmp_path / "paged-mlx" / "kv-cache", tmp_path / "outside"
    directory.mkdir(parents=True)
    if target_exists:
        target.write_text("mine")
        os.utime(target, ns=(0, 0))
    lock = directory / admin.LOCK_FILE
    lock.symlink_to(target)
    refused = f"{lock} is a symbolic link, not a lock file; remove it"
    cache = KVDiskCache(directory, "fake")
    with caught() as seen:
        store(cache, list(range(BLOCK)))  # written; the eviction after it takes the lock
        store(cache, list(range(100, 100 + BLOCK)))  # not written: writing is off
        assert len(cache.load_chain(None, [list(range(BLOCK))], LAYOUT)) == 1
        cache.close()  # its hit count is not added
    assert len(seen) == 1 and refused in str(seen[0].message)
    written = cache._path(chain_hash(None, list(range(BLOCK))))
    assert sorted(p.name for p in directory.iterdir()) == [admin.LOCK_FILE, written.name] and cache.skipped_writes == 1
    result = CliRunner().invoke(cli, ["paged-mlx", "cache", "clear"])
    assert result.exit_code == 1 and isinstance(result.exception, SystemExit), result.output
    assert result.output == f"Error: could not clear {directory}: {refused}\n" and written.is_file()
    assert target.exists() == target_exists and lock.is_symlink()
    if target_exists:
        assert target.read_text() == "mine" and target.stat().st_mtime_ns == 0


# -- the real model -----------------------------------------------------------------


def test_smollm2_follow_up_from_disk_after_restart(tmp_path):
    from smollm2 import smollm2_dir

    from llm_paged_mlx.models.loading import load_model

    model, tokenizer = load_model(str(smollm2_dir()), dequantize=True, dtype="float32")
    model_id = model_identity(smollm2_dir(), tmp_path / "digests.json", dtype="float32")
    chat = [{"role": "user", "content": "Name three primary colors."}]
    prompt = tokenizer.apply_chat_template(chat, add_generation_prompt=True)
    params = SamplingParams(max_tokens=24)

    off = Engine(model, tokenizer, num_blocks=64, enable_prefix_caching=False)
    answer = off.generate([prompt], params)[0]
    chat += [{"role": "assistant", "content": answer.text}, {"role": "user", "content": "And three secondary ones?"}]
    follow_up = tokenizer.apply_chat_template(chat, add_generation_prompt=True)
    assert follow_up[: len(prompt)] == prompt
    expected = off.generate([follow_up], params)[0]

    on = Engine(model, tokenizer, num_blocks=64, kv_disk_cache=KVDiskCache(tmp_path, model_id))
    assert on.generate([prompt], params)[0].token_ids == answer.token_ids
    in_process = on.generate([follow_up], params)[0]
    on.disk.flush()
    restarted = Engine(model, tokenizer, num_blocks=64, kv_disk_cache=KVDiskCache(tmp_path, model_id))
    from_disk = restarted.generate([follow_up], params)[0]
    assert in_process.token_ids == from_disk.token_ids == expected.token_ids
    assert in_process.text == from_disk.text == expected.text
    assert in_process.num_cached_tokens >= len(prompt) // BLOCK * BLOCK
    assert from_disk.num_disk_cached_tokens == (len(follow_up) - 1) // BLOCK * BLOCK  # its own first run saved it all
    mx.clear_cache()


def test_caches_are_freed_when_dropped_and_register_no_exit_hook_each(tmp_path):
    """Each cache registered its own close with atexit, which kept every cache alive to the end."""
    hooks = atexit._ncallbacks()
    caches = [KVDiskCache(tmp_path, f"model {index}") for index in range(3)]
    store(caches[0], list(range(BLOCK)))
    assert atexit._ncallbacks() == hooks
    freed = [weakref.ref(cache) for cache in caches]
    del caches
    gc.collect()
    assert [ref() for ref in freed] == [None] * 3


EXIT_WITHOUT_CLOSE = """
import sys
from llm_paged_mlx.engine.disk.store import KVDiskCache
own, closed_at_exit = sys.argv[1:]
for directory, close_at_exit in [(own, False), (closed_at_exit, True)]:
    cache = KVDiskCache(directory, "model-a", close_at_exit=close_at_exit)
    cache.hits = 2
    globals()[directory] = cache  # alive at exit
"""


def test_only_caches_made_with_close_at_exit_close_at_exit(tmp_path):
    """With close_at_exit=False the owner closes the cache (the llm plugin, after its own shutdown)."""
    run = subprocess.run([sys.executable, "-c", EXIT_WITHOUT_CLOSE, tmp_path / "own", tmp_path / "auto"],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert directory_info(tmp_path / "own")["models"] == {}
    assert directory_info(tmp_path / "auto")["models"] == {"model-a": {"blocks": 0, "bytes": 0, "hits": 2, "misses": 0}}


def test_hit_counts_add_up_across_processes(tmp_path):
    for hits, misses in [(3, 1), (2, 0)]:  # two processes' worth of lookups
        cache = KVDiskCache(tmp_path, "model-a", 1 << 20)
        cache.hits, cache.misses = hits, misses
        cache.close()
        cache.close()  # counted once
    assert directory_info(tmp_path)["models"]["model-a"] == {"blocks": 0, "bytes": 0, "hits": 5, "misses": 1}
    (tmp_path / "hits.json").write_text("not json")
    assert "model-a" not in directory_info(tmp_path)["models"]
    clear_directory(tmp_path)
    assert not (tmp_path / "hits.json").exists()
