"""The arena's step protocol on its own: claim, write, publish, wait; descriptors; a failure breaks it.

Thread ranks (they share this process and its doorbells) open a
communicator's arena with one direct call, then drive its steps by hand.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import tcoll
from tcoll.errors import MismatchError, TcollError, TimeoutError
from tcoll.shm import arena as arena_module


def _arena(comm: tcoll.Communicator) -> arena_module.Arena:
    comm.barrier(algorithm="shm")  # the first direct call opens the arena
    arena = comm._dispatch.arena
    assert arena is not None
    return arena


def _steps_and_slots(comm: tcoll.Communicator) -> list[Any]:
    arena = _arena(comm)
    seen = []
    for _ in range(5):  # more steps than slot sets: sets are reused, one step ahead at most
        step = arena.claim()
        arena.slot(comm.rank, step)[:8] = np.full(8, step * 10 + comm.rank, dtype=np.uint8)
        arena.publish(step)
        arena.wait_all(step)
        seen.append([int(arena.slot(q, step)[0]) for q in range(comm.size)])
        arena.claim()  # a second step per round: nobody rewrites a slot that a slower rank still reads
        arena.publish(arena.step - 1)
    return seen


@pytest.mark.timeout(60)
@pytest.mark.parametrize("size", [2, 3, 5])
def test_every_rank_reads_every_slot_of_a_step(size: int) -> None:
    results = tcoll.spawn(_steps_and_slots, size, threads=True, timeout=50)
    for seen in results:
        assert len(seen) == 5
        for k, row in enumerate(seen):
            step = 2 * k + 1  # step 0 was the barrier's
            assert row == [step * 10 + q for q in range(size)]


def _mismatch(comm: tcoll.Communicator) -> str:
    arena = _arena(comm)
    step = arena.claim()
    fingerprint = arena_module.fingerprint("all_reduce", np.dtype(np.float32), 8 if comm.rank == 0 else 16)
    arena.describe(step, fingerprint)
    arena.publish(step)
    arena.wait_all(step)
    try:
        arena.check_peers(step, fingerprint, "all_reduce")
    except MismatchError as exc:
        try:
            comm.barrier(algorithm="shm")
        except TcollError as later:
            return f"{exc} | {later}"
        return f"{exc} | later call ran"
    return "no mismatch"


@pytest.mark.timeout(60)
def test_a_different_call_is_a_mismatch_and_breaks_the_arena() -> None:
    outcomes = tcoll.spawn(_mismatch, 2, threads=True, timeout=50)
    for outcome in outcomes:
        assert "made a different call" in outcome and "earlier shared-memory collective" in outcome


def _lagging(comm: tcoll.Communicator) -> str:
    arena = _arena(comm)
    arena.timeout = 0.3
    if comm.rank == 0:
        step = arena.claim()
        arena.publish(step)
        try:
            arena.wait_rank(1, step)
        except TimeoutError as exc:
            comm.send(np.zeros(1), 1)  # now rank 1 may leave
            return f"{exc} peers={exc.peers}"
        return "no timeout"
    comm.recv(np.zeros(1), 0)
    return "waited"


@pytest.mark.timeout(60)
def test_a_wait_that_times_out_names_the_lagging_rank() -> None:
    outcome = tcoll.spawn(_lagging, 2, threads=True, timeout=50)[0]
    assert "still waiting on rank(s) [1]" in outcome and "peers=[1]" in outcome


def test_addresses_round_trip_and_an_empty_one_means_failure() -> None:
    encoded = arena_module.encode_address(1 << 20, "/dev/shm/tcoll-x-0-arenaabc")
    assert encoded.size == arena_module.ADDRESS_BYTES
    assert arena_module.decode_address(encoded) == (1 << 20, "/dev/shm/tcoll-x-0-arenaabc")
    assert arena_module.decode_address(np.zeros(arena_module.ADDRESS_BYTES, dtype=np.uint8)) is None


def test_slot_sizes_hold_a_share_per_rank_and_align() -> None:
    assert arena_module.agreed_slot(100, 4) == 256  # 64 bytes per rank at least
    assert arena_module.agreed_slot(1000, 2) == 1024  # rounded up to 64
    assert arena_module.arena_bytes(2, 1024) % 4096 == 0
