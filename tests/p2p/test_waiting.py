"""The doorbell (futex eventcount) and the adaptive spin budget."""

from __future__ import annotations

import os
import threading
import time

import pytest

from tcoll.p2p.waiting import Doorbell, SpinPolicy, bind_share


@pytest.mark.timeout(30)
def test_ring_wakes_a_sleeper() -> None:
    bell = Doorbell.private()
    announced = threading.Event()
    woke: list[float] = []

    def sleeper() -> None:
        seq = bell.prepare_sleep()
        announced.set()
        start = time.monotonic()
        bell.sleep(seq, 20.0)
        woke.append(time.monotonic() - start)
        bell.end_sleep()

    thread = threading.Thread(target=sleeper)
    thread.start()
    announced.wait(10)
    assert bell.sleepers == 1
    bell.ring()  # may land before the futex wait: the sequence moved, so it returns at once
    thread.join(10)
    assert woke and woke[0] < 10.0
    assert bell.sleepers == 0


def test_sleep_returns_at_once_when_the_sequence_moved() -> None:
    bell = Doorbell.private()
    seq = bell.prepare_sleep()
    bell.wake()
    start = time.monotonic()
    bell.sleep(seq, 5.0)
    bell.end_sleep()
    assert time.monotonic() - start < 1.0


def test_sleep_times_out() -> None:
    bell = Doorbell.private()
    seq = bell.prepare_sleep()
    start = time.monotonic()
    bell.sleep(seq, 0.05)
    bell.end_sleep()
    assert 0.04 <= time.monotonic() - start < 2.0


def test_ring_without_sleepers_leaves_the_sequence() -> None:
    bell = Doorbell.private()
    before = bell.prepare_sleep()
    bell.end_sleep()
    bell.ring()
    assert bell.prepare_sleep() == before
    bell.end_sleep()


def test_budget_shrinks_under_long_waits_and_recovers() -> None:
    policy = SpinPolicy(max_us=100, oversubscribed=False)
    for _ in range(50):
        policy.record(0.050, blocked=True)  # waits of 50 ms: polling is wasted
    assert policy.budget_s == pytest.approx(SpinPolicy.MIN_US * 1e-6)
    for _ in range(20):
        policy.record(30e-6, blocked=True)  # the event came 30 us in: a longer budget catches it
    assert policy.budget_s == pytest.approx(100e-6)
    for _ in range(20):
        policy.record(10e-6, blocked=False)
    assert policy.budget_s == pytest.approx(100e-6)


def test_oversubscribed_caps_and_yields() -> None:
    policy = SpinPolicy(max_us=100, oversubscribed=True)
    assert policy.budget_s <= 20e-6
    assert policy.yield_while_polling
    assert not SpinPolicy(max_us=100, oversubscribed=False).yield_while_polling


def test_polls_yield_after_the_flat_out_part() -> None:
    assert SpinPolicy(max_us=100, oversubscribed=False, yield_after_us=7).fast_s == pytest.approx(7e-6)
    assert SpinPolicy(max_us=100, oversubscribed=True, yield_after_us=7).fast_s == 0.0


def run_binding(index: int, count: int) -> tuple[list[int] | None, list[int]]:
    return bind_share(index, count), sorted(os.sched_getaffinity(0))


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="needs Linux affinity")
def test_bind_share_keeps_equal_disjoint_shares_and_leaves_too_few_cores_alone() -> None:
    import multiprocessing

    cores = sorted(os.sched_getaffinity(0))
    context = multiprocessing.get_context("fork")  # binding changes the process: not this one
    if len(cores) >= 2:
        per = len(cores) // 2
        with context.Pool(1) as pool:
            assert pool.apply(run_binding, (1, 2)) == (cores[per:2 * per], cores[per:2 * per])
    with context.Pool(1) as pool:
        assert pool.apply(run_binding, (0, len(cores) + 1)) == (None, cores)


def report_cores(comm: object) -> list[int]:
    return sorted(os.sched_getaffinity(0))


@pytest.mark.timeout(120)
def test_ranks_of_one_host_keep_to_their_cores() -> None:
    import tcoll

    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        pytest.skip("needs 2 cores")
    got = tcoll.spawn(report_cores, 2, timeout=60)
    assert got[0] and got[1] and not set(got[0]) & set(got[1])
    assert tcoll.spawn(report_cores, 2, timeout=60, env={"TCOLL_BIND": "none"}) == [cores, cores]
    assert tcoll.spawn(report_cores, 2, threads=True, timeout=60) == [cores, cores]  # threads: left alone
