"""Swap policies: preempted requests' K/V kept in host memory or in files, bit for bit, and nothing left behind.

Engines with a pool too small for the workload preempt and swap; each request must then get exactly
the tokens of the same engine with a pool big enough never to preempt. Unit tests drive the policies
over fake pools whose arrays have every dtype a pool can have (quantized pools hold uint32).
"""

import errno
import functools
import os
import threading

import mlx.core as mx
import numpy as np
import pytest
from faults import Fault, run_through_faults
from models import tiny_model
from test_engine import collect, random_prompts

from llm_paged_mlx import Engine, SamplingParams, plugins
from llm_paged_mlx.engine import swap
from llm_paged_mlx.engine.disk.format import host
from llm_paged_mlx.engine.kv_groups import kv_groups
from llm_paged_mlx.engine.swap import AutoSwapPolicy, CPUSwapPolicy, DiskSwapPolicy, SwapFile, SwapWarning

LENGTHS = [40, 300, 120, 7, 64, 200]
MAX_TOKENS = 40
DTYPES = {"fp32": mx.float32, "fp16": mx.float16, "bf16": mx.bfloat16}


# -- helpers -------------------------------------------------------------------------------------


@functools.cache
def model(dtype_name):
    m = tiny_model("qwen3")
    m.set_dtype(DTYPES[dtype_name])
    return m


def kv_options(kv_bits):
    if kv_bits is None:
        return {}
    return {"kv_bits": kv_bits, "kv_group_size": 32}  # the tiny model's head_dim


@functools.cache
def expected(dtype_name, kv_bits):
    """The tokens of an engine whose pool never preempts."""
    engine = Engine(model(dtype_name), num_blocks=400, **kv_options(kv_bits))
    outs = engine.generate(random_prompts(LENGTHS), SamplingParams(max_tokens=MAX_TOKENS))
    assert engine.stats()["preemptions"] == 0
    return [o.token_ids for o in outs]


def disk_file(handle):
    """The SwapFile behind a handle of ``disk`` or ``auto``, else None."""
    if isinstance(handle, tuple):
        handle = handle[1]
    return handle if isinstance(handle, SwapFile) else None


class Recorder:
    """Wraps a swap policy: counts the handles it makes and swaps in; ``settle`` waits for each file."""

    def __init__(self, policy, settle=False):
        self.policy, self.settle = policy, settle
        self.handles = self.nones = self.swapped_in = self.from_file = self.discarded = 0

    def swap_out(self, blocks, runner):
        handle = self.policy.swap_out(blocks, runner)
        self.handles += handle is not None
        self.nones += handle is None
        if self.settle and handle is not None:
            self.disk().wait()
        return handle

    def swap_in(self, handle, blocks, runner):
        self.swapped_in += 1
        file = disk_file(handle)
        self.from_file += file is not None and file.arrays is None
        self.policy.swap_in(handle, blocks, runner)

    def discard(self, handle):
        self.discarded += 1
        if hasattr(self.policy, "discard"):
            self.policy.discard(handle)

    def disk(self):
        return self.policy.tiers["disk"] if isinstance(self.policy, AutoSwapPolicy) else self.policy


def swapping_engine(dtype_name, policy, kv_bits=None, settle=False):
    """An engine whose pool is too small for the workload at once, swapping through ``policy``."""
    engine = Engine(model(dtype_name), num_blocks=30, max_num_batched_tokens=64, **kv_options(kv_bits))
    engine.swap = Recorder(policy, settle)
    return engine


def run_by_steps(engine, prompts, params):
    """Add half the prompts, step a few times, add the rest, step to the end."""
    ids = [engine.add_request(p, params) for p in prompts[:3]]
    outputs = {}
    for _ in range(4):
        collect(engine.step(), outputs)
    ids += [engine.add_request(p, params) for p in prompts[3:]]
    while engine.has_unfinished():
        collect(engine.step(), outputs)
    return [outputs.get(i, []) for i in ids]


def run(engine, drive):
    prompts, params = random_prompts(LENGTHS), SamplingParams(max_tokens=MAX_TOKENS)
    if drive == "generate":
        return [o.token_ids for o in engine.generate(prompts, params)]
    return run_by_steps(engine, prompts, params)


def assert_no_files(policy):
    """Once its writes and removals are done, ``policy`` keeps no file and no byte; then close it."""
    policy.wait()
    assert policy.directory is None or os.listdir(policy.directory) == []
    assert policy.used_bytes == 0
    policy.close()


def auto(tier, tmp):
    policy = AutoSwapPolicy(tier=tier)
    policy.tiers["disk"] = DiskSwapPolicy(tmp)
    return policy


POLICIES = {
    "cpu": lambda tmp: (CPUSwapPolicy(), False),
    "disk": lambda tmp: (DiskSwapPolicy(tmp), False),
    "disk from file": lambda tmp: (DiskSwapPolicy(tmp), True),  # each write done before anything swaps in
    "auto cpu": lambda tmp: (auto("cpu", tmp), False),
    "auto disk": lambda tmp: (auto("disk", tmp), True),
}


def engine_cases():
    """Every policy and dtype driven by hand; through ``generate`` in bf16; quantized pools in a few."""
    for name in POLICIES:
        for dtype_name in DTYPES:
            yield name, dtype_name, None, "steps"
        yield name, "bf16", None, "generate"
    for kv_bits in (8, 4):
        for name in ("cpu", "disk from file", "auto disk"):
            for dtype_name in DTYPES:
                yield name, dtype_name, kv_bits, "steps"


CASES = list(engine_cases())


# -- the engine swapping through each policy ------------------------------------------------------


@pytest.mark.parametrize("name,dtype_name,kv_bits,drive", CASES, ids=["-".join(map(str, case)) for case in CASES])
def test_swapped_requests_get_the_tokens_of_an_unlimited_pool(
    name, dtype_name, kv_bits, drive, tmp_path, kv_bits_schedule_free
):
    policy, settle = POLICIES[name](tmp_path)
    engine = swapping_engine(dtype_name, policy, kv_bits, settle)
    got = run(engine, drive)
    recorder = engine.swap
    assert recorder.handles > 0 and recorder.swapped_in > 0 and recorder.nones == 0
    assert got == expected(dtype_name, kv_bits)
    assert engine.stats()["free_blocks"] == engine.stats()["num_blocks"]
    if name.startswith("auto"):
        assert recorder.discarded == recorder.handles  # every handle released, through the policy that made it
    disk = recorder.disk() if "disk" in name else None
    if disk is not None:
        if settle:
            assert recorder.from_file == recorder.swapped_in
        assert disk.directory.parent == tmp_path
        assert_no_files(disk)


def test_the_engine_finds_the_policies_by_name():
    assert {"recompute", "cpu", "disk", "auto"} <= set(plugins.swap_policies())
    assert isinstance(Engine(model("fp32"), num_blocks=30, swap_policy="disk").swap, DiskSwapPolicy)
    assert isinstance(Engine(model("fp32"), num_blocks=30, swap_policy="auto").swap, AutoSwapPolicy)


def test_past_the_disk_budget_requests_are_recomputed(tmp_path):
    engine = swapping_engine("fp32", DiskSwapPolicy(tmp_path, budget_bytes=0))
    assert run(engine, "generate") == expected("fp32", None)
    assert engine.swap.nones > 0 and engine.swap.handles == 0
    assert engine.swap.policy.directory is None  # nothing was ever written


def test_the_disk_budget_bounds_what_is_kept_at_once(tmp_path):
    policy, runner = DiskSwapPolicy(tmp_path), FakePools()
    block = sum(a.nbytes for a in runner.read_blocks([0]))
    policy.budget_bytes = 3 * block
    first = policy.swap_out([0, 1], runner)
    assert first is not None and policy.used_bytes == 2 * block
    assert policy.swap_out([2, 3], runner) is None
    second = policy.swap_out([2], runner)
    assert second is not None and policy.used_bytes == 3 * block
    policy.discard(first)
    assert policy.used_bytes == block and policy.swap_out([3, 4], runner) is not None
    policy.close()


def test_a_failing_background_write_keeps_the_k_v_in_memory(tmp_path, monkeypatch):
    def full_disk(file, array):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(swap, "_write_array", full_disk)
    engine = swapping_engine("bf16", DiskSwapPolicy(tmp_path), settle=True)  # every write has failed before its swap-in
    with pytest.warns(SwapWarning, match="No space left") as warned:
        got = run(engine, "steps")
        engine.swap.policy.wait()
    assert len([w for w in warned if w.category is SwapWarning]) == 1
    assert got == expected("bf16", None)
    assert engine.swap.handles > 0 and engine.swap.swapped_in > 0
    assert_no_files(engine.swap.policy)


def test_a_failed_step_releases_the_file_it_swapped_out_to(tmp_path):
    engine = swapping_engine("fp32", DiskSwapPolicy(tmp_path))
    recorder, forward, failed = engine.swap, engine.runner.forward, []

    def forward_failing_after_a_swap_out(*args, **kwargs):
        if recorder.handles > len(failed) and len(failed) < 2:
            failed.append(recorder.handles)
            raise Fault("the forward pass failed")
        return forward(*args, **kwargs)

    engine.runner.forward = forward_failing_after_a_swap_out
    tokens = run_through_faults(engine, random_prompts(LENGTHS), SamplingParams(max_tokens=MAX_TOKENS))
    assert len(failed) == 2 and recorder.discarded == recorder.handles
    assert tokens == expected("fp32", None)
    assert_no_files(recorder.policy)


def test_a_swap_file_damaged_on_disk_fails_one_step_then_its_request_is_computed_again(tmp_path):
    """The file a request was swapped out to is cut short before it is read back: that step fails with an
    error naming the file, the request is prefilled again, and every request still gets its tokens."""
    engine = swapping_engine("fp32", DiskSwapPolicy(tmp_path), settle=True)
    policy, real_swap_in, errors = engine.swap.policy, engine.swap.swap_in, []

    def swap_in_of_a_damaged_file(handle, blocks, runner):
        if not errors and handle.arrays is None:
            os.truncate(handle.path, 10)
        try:
            return real_swap_in(handle, blocks, runner)
        except RuntimeError as e:
            errors.append(str(e))
            raise

    engine.swap.swap_in = swap_in_of_a_damaged_file
    prompts, params = random_prompts(LENGTHS), SamplingParams(max_tokens=MAX_TOKENS)
    tokens = run_through_faults(engine, prompts, params, (RuntimeError,), max_failures=3)
    assert len(errors) == 1 and "holds 10 bytes" in errors[0]
    assert tokens == expected("fp32", None)
    assert engine.stats()["free_blocks"] == engine.stats()["num_blocks"]
    assert_no_files(policy)


def test_an_aborted_swapped_request_s_file_goes(tmp_path):
    engine = swapping_engine("fp32", DiskSwapPolicy(tmp_path), settle=True)
    params = SamplingParams(max_tokens=MAX_TOKENS)
    for prompt in random_prompts(LENGTHS):
        engine.add_request(prompt, params)
    while not any(r.swap_handle is not None for r in engine.requests.values()):
        engine.step()
    rid, request = next((i, r) for i, r in engine.requests.items() if r.swap_handle is not None)
    path = request.swap_handle.path
    assert path.exists()
    engine.abort(rid)
    engine.swap.policy.wait()
    assert not path.exists()
    while engine.has_unfinished():
        engine.step()
    assert_no_files(engine.swap.policy)


# -- the policies over fake pools --------------------------------------------------------------


class FakePools:
    """Pools of every dtype a swap policy must keep bit for bit (uint32: packed quantized values)."""

    block_size = 16

    def __init__(self, num_blocks=8, windows=(None,)):
        self.groups = kv_groups(windows, uniform=True)  # the block tables of the model's layers
        rng = np.random.default_rng(0)
        raw = [rng.integers(0, 2**32, (num_blocks, 4, 8), dtype=np.uint32) for _ in range(4)]
        self.pools = [
            mx.array(raw[0]).view(mx.float32),  # any bits: NaNs and infinities too
            mx.array(raw[1][..., :4]).view(mx.float16),
            mx.array(raw[2][..., :4]).view(mx.bfloat16),
            mx.array(raw[3]),
        ]

    def read_blocks(self, blocks):
        rows = mx.array(blocks, dtype=mx.int32)
        return [pool[rows] for pool in self.pools]

    def write_blocks(self, blocks, data):
        rows = mx.array(blocks, dtype=mx.int32)
        for pool, array in zip(self.pools, data):
            pool[rows] = array
        mx.eval(self.pools)

    def bits(self, blocks):
        return [host(a).tobytes() for a in self.read_blocks(blocks)]


@pytest.mark.parametrize("name", ["cpu", "disk", "disk from file", "auto cpu", "auto disk"])
def test_policies_keep_arrays_of_any_dtype_bit_for_bit(name, tmp_path):
    policy, settle = POLICIES[name](tmp_path)
    runner = FakePools()
    before = runner.bits([1, 2])
    handle = policy.swap_out([1, 2], runner)
    file = disk_file(handle)
    if settle:
        disk = policy.tiers["disk"] if isinstance(policy, AutoSwapPolicy) else policy
        disk.wait()
        assert file.arrays is None and file.path.stat().st_mode & 0o777 == 0o600
        assert file.path.stat().st_size == file.nbytes
    runner.write_blocks([1, 2], [mx.zeros_like(a) for a in runner.read_blocks([1, 2])])
    policy.swap_in(handle, [5, 3], runner)
    assert runner.bits([5, 3]) == before
    if file is not None:
        policy.discard(handle)
        assert_no_files(policy.tiers["disk"] if isinstance(policy, AutoSwapPolicy) else policy)


def test_a_swap_in_while_the_write_is_pending_uses_the_copy_in_memory(tmp_path, monkeypatch):
    release, started, written = threading.Event(), threading.Event(), []
    write = swap._write_array

    def slow_write(file, array):
        started.set()
        release.wait(120)
        written.append(file.name)
        write(file, array)

    monkeypatch.setattr(swap, "_write_array", slow_write)
    policy, runner = DiskSwapPolicy(tmp_path), FakePools()
    before = runner.bits([0])
    writing = policy.swap_out([0], runner)
    queued = policy.swap_out([1], runner)  # waits behind the first write
    assert started.wait(120)
    policy.swap_in(writing, [6], runner)
    assert runner.bits([6]) == before
    policy.discard(queued)  # never written
    policy.discard(writing)  # removed once written
    release.set()
    assert_no_files(policy)
    assert len(written) == len(runner.pools)  # the first file's arrays only


@pytest.mark.parametrize("damage", ["missing", "truncated", "longer"])
def test_a_damaged_swap_file_is_an_error_naming_it(damage, tmp_path):
    policy, runner = DiskSwapPolicy(tmp_path), FakePools()
    handle = policy.swap_out([0, 1], runner)
    policy.wait()
    if damage == "missing":
        handle.path.unlink()
    else:
        size = handle.path.stat().st_size
        os.truncate(handle.path, size - 1 if damage == "truncated" else size + 8)
    with pytest.raises(RuntimeError, match=str(handle.path)):
        policy.swap_in(handle, [4, 5], runner)
    policy.close()


def test_the_exit_hook_removes_the_folder(tmp_path, monkeypatch):
    hooks = []
    monkeypatch.setattr(swap.atexit, "register", hooks.append)
    default, chosen = DiskSwapPolicy(), DiskSwapPolicy(tmp_path)
    assert hooks == []  # nothing made before the first swap-out
    runner = FakePools()
    handles = [policy.swap_out([0], runner) for policy in (default, chosen)]
    assert hooks == [default.close, chosen.close]
    assert default.directory.name.startswith("llm-paged-mlx-swap-") and chosen.directory.parent == tmp_path
    for policy, handle in zip((default, chosen), handles):
        policy.wait()
        assert handle.path.exists() and policy.directory.stat().st_mode & 0o777 == 0o700
    for hook in hooks:
        hook()
    assert not default.directory.exists() and not chosen.directory.exists() and tmp_path.exists()
    assert default.swap_out([1], runner) is None  # closed: recompute
    default.close()  # twice is harmless


# -- auto's rule ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "blocks,unified,available,tier,windows",
    [
        (32, False, 1 << 40, "recompute", (None,)),  # 512 tokens
        (32, True, 1 << 40, "recompute", (None,)),
        (33, False, 1 << 40, "cpu", (None,)),
        (33, False, 1 << 10, "disk", (None,)),  # the host has no room
        (33, False, None, "disk", (None,)),  # nor any it knows of
        (33, True, 1 << 40, "disk", (None,)),  # unified memory: host memory is the GPU's
        # A full table and two with a 64-token window: 512 tokens hold 32 + 5 + 5 blocks
        (42, False, 1 << 40, "recompute", (None, 64, 64)),
        (43, False, 1 << 40, "cpu", (None, 64, 64)),
    ],
)
def test_auto_picks_a_tier_by_length_and_memory(blocks, unified, available, tier, windows, monkeypatch):
    monkeypatch.setattr(swap, "unified_memory", lambda: unified)
    monkeypatch.setattr(swap, "available_ram", lambda: available)
    runner = FakePools(num_blocks=50, windows=windows)
    policy = AutoSwapPolicy()
    assert policy.choose(list(range(blocks)), runner) == tier
    handle = policy.swap_out(list(range(blocks)), runner)
    if tier == "recompute":
        assert handle is None
    else:
        assert handle[0] is policy.tiers[tier]
        policy.discard(handle)
        policy.tiers["disk"].close()


def test_auto_sends_each_handle_back_to_the_tier_that_made_it(tmp_path):
    policy, runner = AutoSwapPolicy(), FakePools()
    policy.tiers["disk"] = DiskSwapPolicy(tmp_path)
    policy.tier = "cpu"
    in_memory = policy.swap_out([0], runner)
    policy.tier = "disk"
    in_file = policy.swap_out([1], runner)
    before = runner.bits([0, 1])
    policy.tier = "cpu"  # the choice now does not matter
    policy.swap_in(in_file, [2], runner)
    policy.swap_in(in_memory, [3], runner)
    assert runner.bits([3, 2]) == before
    policy.discard(in_memory)
    policy.discard(in_file)
    assert_no_files(policy.tiers["disk"])
