"""The scheduler on its own (no model): admission past a request that does not fit, and the bounds
that keep it from starving, priority preemption on admission, aging, and the preemption bound."""

import itertools

from llm_paged_mlx.engine.block_manager import BlockManager
from llm_paged_mlx.engine.kv_coordinator import KVCoordinator
from llm_paged_mlx.engine.request import Request, SamplingParams, Status
from llm_paged_mlx.engine.scheduler import MAX_BYPASSES, MAX_PREEMPTIONS, FCFSPolicy, PriorityPolicy, Scheduler

BLOCK = 4
_ids = itertools.count()


def request(num_tokens, priority=0):
    return Request(next(_ids), [1] * num_tokens, SamplingParams(max_tokens=1000, priority=priority), 10**6)


def scheduler(num_blocks, policy=None, max_num_seqs=64, budget=1000):
    return Scheduler(KVCoordinator(BlockManager(num_blocks, BLOCK)), policy or FCFSPolicy(), max_num_seqs, budget)


def step(sched):
    """Schedule, and run the plan as the engine would: chunks computed, each completed one samples a token."""
    plan = sched.schedule()
    for victim, _ in plan.preempted:
        victim.num_computed = 0  # recomputed later
    for chunk in plan.chunks:
        done = chunk.completes
        chunk.request.num_computed += chunk.num_tokens
        if done:
            chunk.request.output_token_ids.append(1)
    return plan


def test_a_request_that_does_not_fit_lets_later_ones_in_until_they_have_passed_it_enough():
    sched = scheduler(num_blocks=16)  # 15 usable blocks
    holder = request(8 * BLOCK)
    sched.add(holder)
    step(sched)  # holds 8 blocks, and one more every 4 steps
    big = request(9 * BLOCK)
    sched.add(big)
    smalls = [request(1) for _ in range(MAX_BYPASSES + 3)]
    for small in smalls:
        sched.add(small)
        step(sched)
        sched.remove(small)  # a small request comes and goes while the big one cannot fit
    admitted = [s for s in smalls if s.status is Status.RUNNING]
    assert len(admitted) == MAX_BYPASSES and admitted == smalls[:MAX_BYPASSES]
    assert big.status is Status.WAITING and big.num_bypassed == MAX_BYPASSES
    sched.remove(holder)
    step(sched)
    assert big.status is Status.RUNNING


def test_a_higher_priority_arrival_takes_the_blocks_of_a_lower_one():
    sched = scheduler(11, PriorityPolicy())
    low = request(8 * BLOCK, priority=3)
    sched.add(low)
    step(sched)
    high = request(4 * BLOCK, priority=0)
    sched.add(high)
    plan = step(sched)
    assert [victim for victim, _ in plan.preempted] == [low]
    assert high.status is Status.RUNNING and low.status is Status.WAITING
    assert [c.request for c in plan.chunks] == [high]


def test_an_equal_priority_or_a_fcfs_arrival_never_preempts_on_admission():
    for policy, priorities in ((PriorityPolicy(), (2, 2)), (FCFSPolicy(), (3, 0))):
        sched = scheduler(11, policy)
        running = request(8 * BLOCK, priority=priorities[0])
        sched.add(running)
        step(sched)
        arrival = request(4 * BLOCK, priority=priorities[1])
        sched.add(arrival)
        plan = step(sched)
        assert plan.preempted == [] and arrival.status is Status.WAITING


def test_waiting_ages_a_request_past_later_urgent_ones():
    policy = PriorityPolicy()
    old = request(1, priority=2)
    soon, later = request(1, priority=1), request(1, priority=1)
    soon.arrival_time = old.arrival_time + 0.5 * policy.aging_s  # one level more urgent, arrived half an age later
    later.arrival_time = old.arrival_time + 1.5 * policy.aging_s
    assert policy.key(soon) < policy.key(old) < policy.key(later)
    assert policy.preempts(soon, old) and not policy.preempts(later, old)


def test_a_request_preempted_often_enough_is_not_taken_again():
    for times_preempted, taken in ((MAX_PREEMPTIONS - 1, "last"), (MAX_PREEMPTIONS, "first")):
        sched = scheduler(num_blocks=7)  # 6 usable blocks
        first, last = request(3 * BLOCK), request(3 * BLOCK)
        sched.add(first)
        sched.add(last)
        step(sched)  # three blocks each, full after the sampled token: the next token needs a block
        last.num_preemptions = times_preempted
        plan = step(sched)
        victims = [victim for victim, _ in plan.preempted]
        assert victims == [last if taken == "last" else first]  # else `first` yields its own blocks
        assert (first.status, last.status) == (
            (Status.RUNNING, Status.WAITING) if taken == "last" else (Status.WAITING, Status.RUNNING)
        )
