"""The arena's step protocol on its own: claim, write, publish, wait; descriptors; a failure breaks it.

Thread ranks (they share this process and its doorbells) open a
communicator's arena with one direct call, then drive its steps by hand.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import tcoll
from tcoll import segments
from tcoll.algos import stamps
from tcoll.errors import MismatchError, TimeoutError
from tcoll.segments import Segment
from tcoll.shm import arena as arena_module
from tcoll.shm import address as address_module


def _arena(comm: tcoll.Communicator) -> arena_module.Arena:
    comm.barrier(algorithm="shm")  # the first direct call opens the arena
    arena = comm.core.dispatch.arena
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
    stamp = stamps.stamp("all_reduce", "all_reduce", None, np.dtype(np.float32), 8 if comm.rank == 0 else 16, 0, "shm")
    arena.begin(stamp, 7, "all_reduce")
    step = arena.first_step()
    arena.publish(step)
    try:
        arena.agree(step)
    except MismatchError as exc:
        return f"{exc} | steps {arena.step}"
    return "no mismatch"


@pytest.mark.timeout(60)
def test_a_different_call_is_a_mismatch_on_every_rank_at_the_same_step() -> None:
    outcomes = tcoll.spawn(_mismatch, 2, threads=True, timeout=50)
    assert "all_reduce #7 (shm): rank 1 called all_reduce(16 elements) where rank 0 called all_reduce(8 elements)" \
        in outcomes[0]
    assert "rank 0 called all_reduce(8 elements) where rank 1 called all_reduce(16 elements)" in outcomes[1]
    assert outcomes[0].endswith("steps 2") and outcomes[1].endswith("steps 2")  # both stand at the same step


def _shifted(comm: tcoll.Communicator) -> str:
    arena = _arena(comm)
    stamp = stamps.stamp("barrier", "barrier", None, None, 0, 0, "shm")
    arena.begin(stamp, 5 if comm.rank == 0 else 6, "barrier")  # rank 0 is a call behind
    step = arena.first_step()
    arena.publish(step)
    try:
        arena.agree(step)
    except MismatchError as exc:
        return str(exc)
    return "no mismatch"


@pytest.mark.timeout(60)
def test_a_rank_a_call_behind_is_named() -> None:
    outcomes = tcoll.spawn(_shifted, 2, threads=True, timeout=50)
    assert "rank 1 is at its call #6" in outcomes[0] and "where rank 0 is at #5" in outcomes[0]


def _lagging(comm: tcoll.Communicator) -> str:
    arena = _arena(comm)
    arena.timeout = 0.3
    if comm.rank == 0:
        arena.begin(0, 9, "broadcast")
        step = arena.first_step()
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
    assert "broadcast #9 (shm) did not complete within 0.3 s: rank(s) [1] never entered it" in outcome
    assert "peers=[1]" in outcome


def test_addresses_round_trip_and_an_empty_one_means_failure() -> None:
    named = Segment("/dev/shm/tcoll-x-0-arenaabc", 0, None)
    encoded = address_module.encode_address(1 << 20, 16 << 10, 256 << 10, named)
    assert encoded.size == address_module.ADDRESS_BYTES
    assert address_module.decode_address(encoded) == (1 << 20, 16 << 10, 256 << 10, "off",
                                                      "/dev/shm/tcoll-x-0-arenaabc", None)
    for mode in ("on", "auto"):
        tried = address_module.encode_address(1 << 20, 16 << 10, 1 << 20, named, single_copy=mode)
        assert address_module.decode_address(tried) == (1 << 20, 16 << 10, 1 << 20, mode,
                                                        "/dev/shm/tcoll-x-0-arenaabc", None)
    # the longest: a 64-character run id, a memfd's /proc path and its name
    memfd = Segment(f"/proc/{2**22}/fd/1048576", 0, None)
    memfd.name = segments.segment_name("r" * 64, 4095, "arena" + "f" * 12)
    found = address_module.decode_address(address_module.encode_address(1 << 40, 1 << 40, 1 << 40, memfd, "auto"))
    assert found == (1 << 40, 1 << 40, 1 << 40, "auto", memfd.path, memfd.name)
    assert address_module.decode_address(np.zeros(address_module.ADDRESS_BYTES, dtype=np.uint8)) is None


def test_slot_sizes_hold_a_share_per_rank_and_align() -> None:
    assert address_module.agreed_slot(100, 4) == 256  # 64 bytes per rank at least
    assert address_module.agreed_slot(1000, 2) == 1024  # rounded up to 64
    assert arena_module.arena_bytes(2, 1024) % 4096 == 0
