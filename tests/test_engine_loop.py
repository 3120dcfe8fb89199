"""The engine loop: requests from many threads and coroutines share one engine's steps on the loop's thread."""

import asyncio
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from faults import Fault, Injector
from models import tiny_model
from test_engine import random_prompts, reference

from llm_paged_mlx import Engine, SamplingParams
from llm_paged_mlx.engine.loop import EXIT_WAIT_S, MAX_STEP_FAILURES, EngineLoop, LoopStopped, QueueFull, StepFailed


def tiny_loop(num_blocks=64, built=None, **loop_options) -> EngineLoop:
    """A loop over a tiny llama engine; each config is the engine's ``num_blocks``. ``built`` lists the engines."""
    built = [] if built is None else built

    def build(config, weights):
        model = weights[0] if weights else tiny_model("llama")
        built.append(Engine(model, None, num_blocks=config or num_blocks))
        return built[-1]

    return EngineLoop(build, **loop_options)


def tokens_of(submission) -> list[int]:
    return [t for chunk in submission for t in chunk.token_ids]


def error_of(submission) -> Exception:
    """The error reading ``submission`` raises (the test fails if it raises none)."""
    with pytest.raises(Exception) as raised:
        tokens_of(submission)
    return raised.value


def wait_until(condition, timeout=120.0):
    """Poll ``condition`` until it holds; ``timeout`` bounds a hang, it measures no speed."""
    end = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.005)


def read_within(read, timeout=120.0):
    """``read()`` run on another thread: a reader that hangs fails the test instead of hanging it."""
    result = []
    reader = threading.Thread(target=lambda: result.append(read()), daemon=True)
    reader.start()
    reader.join(timeout)
    assert result, "the reader hangs"
    return result[0]


def test_requests_from_many_threads_give_mlx_lm_tokens_and_share_steps():
    loop = tiny_loop(num_blocks=40)  # small enough that some requests are preempted
    prompts = random_prompts([3, 17, 40, 100, 5, 64, 33, 250], seed=3)
    results = [None] * len(prompts)

    def ask(i):
        results[i] = tokens_of(loop.submit(prompts[i], SamplingParams(max_tokens=24)))

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(prompts))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    model = tiny_model("llama")
    assert results == [reference(model, p, 24) for p in prompts]
    assert loop.num_steps < sum(24 + -(-len(p) // 2048) for p in prompts)  # steps were shared
    assert loop.stats["used_blocks"] == 0 and loop.stats["running"] == 0
    loop.stop()


def test_coroutines_share_steps_and_get_their_own_tokens():
    loop = tiny_loop()
    prompts = random_prompts([9, 30, 2, 70], seed=4)

    async def ask(prompt):
        return [t async for chunk in loop.submit(prompt, SamplingParams(max_tokens=16)) for t in chunk.token_ids]

    async def main():
        return await asyncio.gather(*(ask(p) for p in prompts))

    model = tiny_model("llama")
    assert asyncio.run(main()) == [reference(model, p, 16) for p in prompts]
    assert loop.num_steps < 4 * 16
    loop.stop()


def test_cancel_frees_the_blocks_within_one_step_and_others_go_on(monkeypatch):
    loop = tiny_loop()
    long = loop.submit([1, 2, 3], SamplingParams(max_tokens=1000, ignore_eos=True))
    other = loop.submit([4, 5, 6], SamplingParams(max_tokens=40))
    cancelling, still_there = threading.Event(), []
    step = Engine.step

    def watched_step(engine):
        if cancelling.is_set():
            still_there.append(long.request_id in engine.requests)
        return step(engine)

    monkeypatch.setattr(Engine, "step", watched_step)
    chunks = iter(long)
    next(chunks), next(chunks)
    long.cancel()
    cancelling.set()
    wait_until(lambda: long.request_id not in loop.engine.requests)
    assert sum(still_there) <= 1  # of the steps begun after the cancel was queued, at most one before it was taken
    assert tokens_of(other) == reference(tiny_model("llama"), [4, 5, 6], 40)
    wait_until(lambda: loop.stats["used_blocks"] == 0)
    loop.stop()


def test_breaking_out_of_the_iteration_cancels_the_request():
    loop = tiny_loop()
    for chunk in loop.submit([7, 8], SamplingParams(max_tokens=1000, ignore_eos=True)):
        break
    wait_until(lambda: loop.stats["running"] == 0 and loop.stats["used_blocks"] == 0)
    loop.stop()


def test_a_request_cancelled_before_the_engine_takes_it_ends_with_abort():
    """Cancelled while the loop is busy admitting another, or while it waits for a rebuild: the reader gets an
    "abort" chunk (sync and async), never a hang, and nothing is left counted as waiting."""
    loop = tiny_loop()
    admitting, release = threading.Event(), threading.Event()

    def slow_prompt(tokenizer):
        admitting.set()
        release.wait()
        return [1, 2]

    blocker = loop.submit(slow_prompt, SamplingParams(max_tokens=3))
    admitting.wait()
    queued = loop.submit([3, 4], SamplingParams(max_tokens=3))
    queued.cancel()
    release.set()
    assert read_within(lambda: [(c.token_ids, c.finish_reason) for c in queued]) == [([], "abort")]
    assert tokens_of(blocker) == reference(tiny_model("llama"), [1, 2], 3)

    long = loop.submit([1, 2, 3], SamplingParams(max_tokens=1000, ignore_eos=True))
    next(iter_long := iter(long))
    deferred = loop.submit([5], SamplingParams(max_tokens=2), config=32)  # waits for the engine to be idle
    wait_until(lambda: deferred in loop._deferred)
    deferred.cancel()

    async def read():
        return [chunk.finish_reason async for chunk in deferred]

    assert asyncio.run(asyncio.wait_for(read(), 30)) == ["abort"]
    iter_long.close()
    wait_until(lambda: loop.stats["used_blocks"] == 0 and loop.num_waiting() == 0)
    loop.stop()


def test_an_error_in_one_request_reaches_that_request_alone():
    loop = tiny_loop(num_blocks=8)  # 7 usable blocks of 16 tokens
    good = loop.submit([1, 2, 3], SamplingParams(max_tokens=8))
    too_long = loop.submit(list(range(200)), SamplingParams(max_tokens=8))
    bad_template = loop.submit(lambda tokenizer: 1 / 0, SamplingParams(max_tokens=8))
    with pytest.raises(ValueError, match="does not fit the KV cache"):
        tokens_of(too_long)
    with pytest.raises(ZeroDivisionError):
        tokens_of(bad_template)
    assert tokens_of(good) == reference(tiny_model("llama"), [1, 2, 3], 8)
    loop.stop()


def test_a_step_that_keeps_failing_fails_the_requests_in_it_and_the_loop_goes_on(monkeypatch):
    built = []
    loop = tiny_loop(built=built)
    warm = loop.submit([1], SamplingParams(max_tokens=1))
    tokens_of(warm)
    calls = []
    step = Engine.step

    def failing_step(engine):
        calls.append(1)
        if len(calls) <= MAX_STEP_FAILURES:
            raise Fault("injected")
        return step(engine)

    monkeypatch.setattr(Engine, "step", failing_step)
    doomed = loop.submit([1, 2, 3], SamplingParams(max_tokens=8))
    with pytest.raises(StepFailed, match="failed 3 steps in a row: injected") as failed:
        tokens_of(doomed)
    assert isinstance(failed.value.__cause__, Fault)
    assert not built[0].requests and built[0].stats()["used_blocks"] == 0
    assert tokens_of(loop.submit([1, 2, 3], SamplingParams(max_tokens=8))) == reference(tiny_model("llama"), [1, 2, 3], 8)
    loop.stop()


def test_a_fault_outside_a_step_reaches_the_requests_and_the_loop_goes_on(monkeypatch):
    built = []
    loop = tiny_loop(built=built)
    running = loop.submit([1, 2, 3], SamplingParams(max_tokens=1000, ignore_eos=True))
    cancelled = iter(loop.submit([4, 5], SamplingParams(max_tokens=1000, ignore_eos=True)))
    next(cancelled)
    Injector(monkeypatch, Engine, "abort", fail_on=[1])  # the cancel's abort fails; the loop's own aborts work
    cancelled.close()  # cancels it
    error = read_within(lambda: error_of(running))
    assert isinstance(error, Fault) and "abort failed" in str(error)
    assert not built[0].requests and built[0].stats()["used_blocks"] == 0
    again = loop.submit([1, 2, 3], SamplingParams(max_tokens=8))
    assert read_within(lambda: tokens_of(again)) == reference(tiny_model("llama"), [1, 2, 3], 8)
    loop.stop()


def test_a_step_that_fails_once_is_tried_again(monkeypatch):
    loop = tiny_loop()
    calls = []
    step = Engine.step

    def flaky_step(engine):
        calls.append(1)
        if len(calls) == 3:
            raise Fault("injected")
        return step(engine)

    monkeypatch.setattr(Engine, "step", flaky_step)
    assert tokens_of(loop.submit([5, 6], SamplingParams(max_tokens=12))) == reference(tiny_model("llama"), [5, 6], 12)
    loop.stop()


def test_another_config_waits_for_the_engine_to_be_idle_and_reuses_the_weights():
    built = []
    loop = tiny_loop(built=built)
    first = loop.submit([1, 2], SamplingParams(max_tokens=30), config=64)
    chunks = iter(first)
    next(chunks)
    second = loop.submit([3, 4], SamplingParams(max_tokens=5), config=32)
    model = tiny_model("llama")
    assert [t for chunk in chunks for t in chunk.token_ids] == reference(model, [1, 2], 30)[1:]
    assert tokens_of(second) == reference(model, [3, 4], 5)
    assert [engine.max_blocks for engine in built] == [64, 32] and built[0].model is built[1].model
    loop.stop()


def test_a_full_queue_refuses_and_a_stopped_loop_ends_its_requests():
    release = threading.Event()

    def slow_build(config, weights):
        release.wait()
        return Engine(tiny_model("llama"), None, num_blocks=64)

    loop = EngineLoop(slow_build, max_waiting=2)
    waiting = [loop.submit([1, 2], SamplingParams(max_tokens=2000, ignore_eos=True)) for _ in range(2)]
    with pytest.raises(QueueFull, match="2 requests are waiting"):
        loop.submit([3], SamplingParams(max_tokens=4))
    release.set()
    running = iter(waiting[0])
    next(running)
    threading.Thread(target=loop.stop).start()
    for chunks in (running, waiting[1]):
        with pytest.raises(LoopStopped):
            tokens_of(chunks)
    loop.parked.wait(timeout=30)
    with pytest.raises(LoopStopped):
        loop.submit([1])


def test_stop_can_be_asked_without_waiting_and_on_stop_runs_once():
    stopped = []
    loop = tiny_loop(on_stop=lambda: stopped.append(1))
    running = iter(loop.submit([1, 2], SamplingParams(max_tokens=1000, ignore_eos=True)))
    next(running)
    assert loop.request_stop() and not loop.request_stop()  # returns at once; the second is a no-op
    with pytest.raises(LoopStopped):
        list(running)
    loop.stop()
    loop.stop()
    assert loop.parked.is_set() and stopped == [1]


def test_a_stop_ends_the_readers_at_once_even_during_a_long_step(monkeypatch):
    loop = tiny_loop()
    in_step, release, step = threading.Event(), threading.Event(), Engine.step

    def long_step(engine):
        in_step.set()
        release.wait()
        return step(engine)

    monkeypatch.setattr(Engine, "step", long_step)
    waiting = loop.submit([1, 2], SamplingParams(max_tokens=4))
    in_step.wait()

    def read():
        with pytest.raises(LoopStopped):
            tokens_of(waiting)
        return True

    loop.request_stop()
    assert read_within(read)  # while the step still runs
    release.set()
    loop.stop()


def test_a_failed_build_reaches_its_request_and_the_next_one_builds_again():
    attempts = []

    def build(config, weights):
        attempts.append(config)
        if len(attempts) == 1:
            raise OSError("no such model folder")
        return Engine(tiny_model("llama"), None, num_blocks=64)

    loop = EngineLoop(build)
    with pytest.raises(OSError, match="no such model folder"):
        tokens_of(loop.submit([1, 2]))
    assert tokens_of(loop.submit([1, 2], SamplingParams(max_tokens=3))) == reference(tiny_model("llama"), [1, 2], 3)
    loop.stop()


STEP_THAT_NEVER_ENDS = """
import threading
from test_engine_loop import tiny_loop
from llm_paged_mlx import Engine, SamplingParams

in_step = threading.Event()
def never_ends(engine):
    in_step.set()
    threading.Event().wait()
Engine.step = never_ends
tiny_loop().submit([1, 2], SamplingParams(max_tokens=4))
assert in_step.wait(60)
"""  # and the script ends: the process exits with the loop's thread in a step


def test_an_exit_does_not_wait_past_its_bound_for_a_step_that_does_not_end():
    """The exit gives up on the step (a wait for it would outlast the run's timeout, which bounds a hang)."""
    started = time.monotonic()
    run = subprocess.run([sys.executable, "-c", STEP_THAT_NEVER_ENDS], capture_output=True, text=True, timeout=120,
                         cwd=Path(__file__).parent)
    assert run.returncode == 130, run.stderr  # ended by the loop, without C++ destructors
    assert "did not end within" in run.stderr and "Traceback" not in run.stderr, run.stderr
    assert time.monotonic() - started >= EXIT_WAIT_S  # it waited for the step first
