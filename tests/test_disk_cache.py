"""The disk tier of the prefix cache: same tokens from disk as computed, across restarts; bad files and
failing writes cost only recomputation; the size budget evicts least recently used files."""

import contextlib
import errno
import json
import os
import subprocess
import sys
import threading
import warnings
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from models import tiny_model
from safetensors.numpy import load as load_safetensors
from safetensors.numpy import save as save_safetensors
from test_engine import random_prompts, reference

from llm_paged_mlx import Engine, SamplingParams
from llm_paged_mlx.engine import disk_cache
from llm_paged_mlx.engine.block_manager import chain_hash
from llm_paged_mlx.engine.disk_cache import (
    KVDiskCache,
    KVDiskCacheWarning,
    clear_directory,
    directory_info,
    model_identity,
)

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
from llm_paged_mlx.engine.disk_cache import KVDiskCache
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
        engine = cached_engine(model, tmp_path)
        out = engine.generate([follow_up], GREEDY)[0]
        engine.disk.flush()
    assert out.token_ids == reference(model, follow_up, 12)
    assert out.num_disk_cached_tokens == 2 * BLOCK  # the blocks before the bad one
    assert len(seen) == 1 and bad.name in str(seen[0].message)
    assert bad.read_bytes() != damaged  # removed, then written again from the recomputed K/V
    blocks = [prompt[i * BLOCK : (i + 1) * BLOCK] for i in range(3)]
    assert len(KVDiskCache(tmp_path, "tiny").load_chain(None, blocks, _layout(engine))) == 3


def _layout(engine):
    return engine.scheduler.load_blocks.keywords["layout"]


def test_a_failing_write_warns_once_and_leaves_nothing(tmp_path, monkeypatch):
    def disk_full(file, payload):
        file.write(payload[: len(payload) // 2])
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(disk_cache, "_write_all", disk_full)
    model = tiny_model("llama")
    prompt = random_prompts([100], seed=13)[0]
    with caught() as seen:
        engine = cached_engine(model, tmp_path)
        out = engine.generate([prompt], GREEDY)[0]
        engine.disk.flush()
    assert out.token_ids == reference(model, prompt, 12)
    assert len(seen) == 1 and "No space left" in str(seen[0].message)
    assert list(tmp_path.iterdir()) == []
    assert engine.disk.info()["write_errors"] == 6
    monkeypatch.undo()
    assert engine.generate([prompt], GREEDY)[0].token_ids == out.token_ids
    engine.disk.flush()
    assert engine.disk.info()["blocks"] == 6


def test_files_are_private(tmp_path):
    first_turn(tiny_model("llama"), tmp_path / "kv", random_prompts([40])[0])
    assert (tmp_path / "kv").stat().st_mode & 0o777 == 0o700
    files = list((tmp_path / "kv").iterdir())
    assert len(files) == 3 and all(f.stat().st_mode & 0o777 == 0o600 for f in files)


# -- the cache on its own: eviction, info, clear --------------------------------------

LAYOUT = [((2 * BLOCK, 8), mx.float32)] * 4  # two layers of K and V, 2 heads of dim 8


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
    cache.save(tokens, list(range(len(tokens) // BLOCK)), BLOCK, read_blocks)
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
    real_write = disk_cache._write_all
    monkeypatch.setattr(disk_cache, "_write_all", lambda file, payload: release.wait() and real_write(file, payload))
    block_bytes = 4 * 2 * BLOCK * 8 * 4  # LAYOUT in float32
    cache = KVDiskCache(tmp_path, "fake", max_pending_bytes=int(1.5 * block_bytes))
    read_blocks, _ = fake_blocks(0)
    assert cache.save(list(range(3 * BLOCK)), [1, 2, 3], BLOCK, read_blocks) == 1
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
    assert list(tmp_path.iterdir()) == [] and second.info()["blocks"] == 0
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
    base = model_identity(tmp_path, dtype="float32")
    assert base == model_identity(tmp_path, dtype="float32") != model_identity(tmp_path, dtype="float16")
    (tmp_path / "model.safetensors").write_bytes(b"other weights")
    assert model_identity(tmp_path, dtype="float32") != base


def test_the_disk_tier_needs_the_prefix_cache(tmp_path):
    with pytest.raises(ValueError, match="needs enable_prefix_caching"):
        Engine(tiny_model("llama"), num_blocks=8, enable_prefix_caching=False, kv_disk_cache=KVDiskCache(tmp_path, "x"))


# -- the real model -----------------------------------------------------------------


def test_smollm2_follow_up_from_disk_after_restart(tmp_path):
    from smollm2 import smollm2_dir

    from llm_paged_mlx.models.loading import load_model

    model, tokenizer = load_model(str(smollm2_dir()), dequantize=True, dtype="float32")
    model_id = model_identity(smollm2_dir(), dtype="float32")
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


def test_hit_counts_add_up_across_processes(tmp_path):
    from llm_paged_mlx.engine.disk_cache import KVDiskCache, clear_directory, directory_info

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
