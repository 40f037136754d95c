"""Streamed steps of the C kernel: a broadcast's root and a gather's other ranks announce each chunk they
write on their progress line, and the readers copy it while the next is written.

On real ranks: broadcasts and gathers from 32 KiB to a slot against NumPy, every rank in C, one rank in
Python beside them (a writer in Python never writes its progress line: the readers go by its counter), a
root whose buffer is lent, ranks late by turns, and sizes that differ (every rank raises). On an arena's
memory in this process, where the test plays the peer: what a writer announces, what a reader copies of a
peer's announced chunks, and what it leaves to Python (a stalled writer, a descriptor that differs).
"""

from __future__ import annotations

import time

import numpy as np
import pytest

import tcoll
from tcoll.shm import arena as arena_module

from helpers.fake_arena import STAMP, CountingKernel, FakeArena, counted_kernel
from helpers.mismatch import assert_every_rank_raised, mismatch_said

pytestmark = pytest.mark.usefixtures("no_leftovers")
needs_kernel = pytest.mark.skipif(arena_module.kernel_module is None, reason="the C kernel is not built")
K = arena_module.kernel_module
SIZES = (32 << 10, 100_004, 256 << 10, 1 << 20)  # bytes: the first streamed size, odd, lending, a whole slot


class Counting(CountingKernel):
    """CountingKernel that counts broadcasts too."""

    def run_broadcast(self, *args: object) -> int:
        return self._counted(self.kernel.run_broadcast(*args))


def _busy(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def _values(rank: int, call: int, nbytes: int) -> np.ndarray:
    return ((np.arange(nbytes // 4, dtype=np.int64) * 7 + rank * 1000 + call * 13) % 65521).astype(np.float32)


def streamed_calls(comm: tcoll.Communicator, python_rank: int, lend: bool, calls: int) -> tuple[list[str], dict]:
    """Broadcasts and gathers of SIZES, roots and a late rank by turns; (failures, kernel states seen)."""
    counting = counted_kernel(comm, Counting, python_rank)
    p, me, bad = comm.size, comm.rank, []
    for call in range(calls):
        nbytes, root, late = SIZES[call % len(SIZES)], call % p, (call // 2) % p
        mine = _values(me, call, nbytes)
        if me == late:
            _busy(0.0003)
        if call % 2 == 0:
            x = comm.empty(mine.shape, np.float32) if lend and me == root else np.empty_like(mine)
            x[...] = mine if me == root else 0
            comm.broadcast(x, root=root, algorithm="shm")
            if not np.array_equal(x, _values(root, call, nbytes)):
                bad.append(f"rank {me}: broadcast #{call} of {nbytes} B from {root}")
        else:
            got = comm.gather(mine, root=root, algorithm="shm")
            want = np.stack([_values(q, call, nbytes) for q in range(p)]) if me == root else None
            if (want is None) != (got is None) or (want is not None and not np.array_equal(got, want)):
                bad.append(f"rank {me}: gather #{call} of {nbytes} B to {root}")
    return bad, dict(counting.states)


@needs_kernel
@pytest.mark.timeout(120)
@pytest.mark.parametrize("size", [2, 3])
def test_streamed_broadcasts_and_gathers_match_numpy(size: int) -> None:
    results = tcoll.spawn(streamed_calls, size, (-1, False, 24), timeout=100, transport="shm")
    assert not [f for bad, _ in results for f in bad], results
    if size == 2:  # (more ranks than cores: a call finishes in the kernel only when every rank comes within the spin)
        assert all(states.get(K.DONE) for _, states in results), results


@needs_kernel
@pytest.mark.timeout(120)
@pytest.mark.parametrize("python_rank", [0, 1])
def test_a_rank_in_python_pairs_with_streaming_ranks(python_rank: int) -> None:
    """One rank takes the Python steps (root or not by turns): it never writes its progress line."""
    results = tcoll.spawn(streamed_calls, 3, (python_rank, False, 24), timeout=100, transport="shm")
    assert not [f for bad, _ in results for f in bad], results
    assert not results[python_rank][1], results


@needs_kernel
@pytest.mark.timeout(120)
def test_a_lent_root_buffer_is_read_in_place_beside_streaming_readers() -> None:
    results = tcoll.spawn(streamed_calls, 2, (-1, True, 24), timeout=100, transport="shm")
    assert not [f for bad, _ in results for f in bad], results
    assert any(states.get(K.PUBLISHED) for _, states in results), results  # (the root lent: Python reads)


def differing(comm: tcoll.Communicator, name: str, kib: tuple[int, int]) -> tuple[str, bool]:
    """Rank 0 passes kib[0] KiB where the others pass kib[1] KiB; then a right call."""
    x = np.ones(kib[0 if comm.rank == 0 else 1] << 8, np.float32)
    said = mismatch_said(lambda: getattr(comm, name)(x, root=1, algorithm="shm"))
    got = comm.all_gather(np.array([comm.rank]), algorithm="shm")
    return said, bool(np.array_equal(got.ravel(), np.arange(comm.size)))


@needs_kernel
@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", ["broadcast", "gather"])
@pytest.mark.parametrize("kib", [(40, 48), (40, 80)])  # (the second: one step against the lenders' two)
def test_streamed_calls_that_differ_raise_on_every_rank(name: str, kib: tuple[int, int]) -> None:
    results = tcoll.spawn(differing, 3, (name, kib), timeout=50, transport="shm")
    assert_every_rank_raised(results, (name, kib))


class WideArena(FakeArena):
    SLOT = 64 << 10  # room for a streamed call


def _broadcast(fake: FakeArena, buf: np.ndarray, root: int, stamp: int = STAMP, step: int = 0) -> int:
    return fake.kernel.run_broadcast(buf, root, False, step, stamp, 7, 0, False)


@needs_kernel
def test_a_streaming_root_announces_its_chunks_then_publishes() -> None:
    fake = WideArena()
    data = np.arange(40 << 10, dtype=np.uint8)
    assert _broadcast(fake, data, 0) == K.PUBLISHED  # the peer never came: Python waits
    assert fake.progress(0).tolist() == [1, data.nbytes] and fake.counters[0] == 1
    assert np.array_equal(fake.slot(0, 0, np.uint8, data.nbytes), data)


@needs_kernel
def test_a_reader_copies_the_announced_chunks_and_hands_a_stalled_writer_to_python() -> None:
    fake = WideArena()
    data = (np.arange(40 << 10) % 251).astype(np.uint8)
    fake.desc[8:12] = [STAMP & (2**64 - 1), STAMP >> 64, 7, 0]  # the root (rank 1) describes the call ...
    fake.slot(1, 0, np.uint8, data.nbytes)[...] = data
    fake.progress(1)[:] = [1, 16 << 10]  # ... and announces its first 16 KiB, but never publishes
    out = np.zeros_like(data)
    assert _broadcast(fake, out, 1) == K.PUBLISHED
    assert np.array_equal(out[:16 << 10], data[:16 << 10]) and not out[16 << 10:].any()
    fake.counters[1] = 1  # it publishes: the whole is there
    out[...] = 0
    fake.counters[0] = 0
    assert _broadcast(fake, out, 1) == K.DONE and np.array_equal(out, data)


@needs_kernel
def test_a_reader_copies_nothing_of_a_root_that_describes_another_call() -> None:
    fake = WideArena()
    fake.desc[8:12] = [STAMP & (2**64 - 1), STAMP >> 64, 8, 0]  # another call (#8)
    fake.slot(1, 0, np.uint8, 40 << 10)[...] = 5
    fake.progress(1)[:] = [1, 40 << 10]
    fake.counters[1] = 1
    out = np.zeros(40 << 10, np.uint8)
    assert _broadcast(fake, out, 1) == K.PUBLISHED and not out.any()
