"""The C kernel's loops over the pieces of calls larger than a slot (tcoll/shm/pieces.h): all_reduce and
reduce, and broadcast and gather (streamed).

On real ranks: all_reduce and reduce of several sizes, dtypes and ops against NumPy folded in rank order,
and broadcasts and gathers from every root, every rank in C; one rank in Python beside them (the phases pair); one
rank's buffer lent (the kernel stops at the first piece and Python reads it in place); a rank late by
turns (the kernel stops at a wait and Python takes that phase); sizes that differ (every rank raises). On
an arena's memory in this process, where the test plays the peer: each phase's words and bytes, a call
resumed phase by phase, and what the kernel leaves to Python (a descriptor that differs, a peer that lent).
"""

from __future__ import annotations

import time
from collections import Counter

import numpy as np
import pytest

import tcoll
from tcoll.p2p.waiting import SpinPolicy
from tcoll.shm import arena as arena_module
from tcoll.shm.address import PIECE_BYTES, SLOT_BYTES, SLOT_BYTES_SHARED

from helpers.fake_arena import STAMP, FakeArena, counted_kernel
from helpers.mismatch import assert_every_rank_raised, mismatch_said

pytestmark = pytest.mark.usefixtures("no_leftovers")
needs_kernel = pytest.mark.skipif(arena_module.kernel_module is None, reason="the C kernel is not built")
K = arena_module.kernel_module
SLOT = 16 << 10  # the ranks' arena slot, and so their piece: calls larger take the pieces
SIZES = (SLOT + 4, 3 * SLOT - 24, 5 * SLOT + 1000)  # bytes: two pieces, three (the last short), six
KINDS = ["reductions", "broadcasts", "gathers"]
CASES = [(np.float32, "sum", np.add), (np.int64, "max", np.maximum), (np.float64, "prod", np.multiply)]


class PieceCounting:
    """Stands in for an arena's kernel and counts how its loops of pieces ended: "all" phases, or "early"."""

    def __init__(self, kernel: object) -> None:
        self.kernel, self.ends = kernel, Counter()

    def run_pieces(self, *args: object) -> int:
        done = self.kernel.run_pieces(*args)
        self.ends["all" if done == 3 * -(-memoryview(args[0]).nbytes // args[9]) else "early"] += 1
        return done

    def _rooted(self, loop: str, *args: object) -> int:
        done = getattr(self.kernel, loop)(*args)
        self.ends["all" if done == 2 * -(-memoryview(args[0]).nbytes // SLOT) else "early"] += 1
        return done

    def run_broadcast_pieces(self, *args: object) -> int:
        return self._rooted("run_broadcast_pieces", *args)

    def run_gather_pieces(self, *args: object) -> int:
        return self._rooted("run_gather_pieces", *args)

    def __getattr__(self, name: str) -> object:
        return getattr(self.kernel, name)


def _busy(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def _input(rank: int, call: int, count: int, dtype: type) -> np.ndarray:
    values = (np.arange(count, dtype=np.int64) * 7 + rank * 1000 + call * 13) % 97 + 1
    return (values / 64 + 0.5).astype(dtype) if np.dtype(dtype).kind == "f" else values.astype(dtype) - 40


def _folded(ufunc: np.ufunc, inputs: list[np.ndarray]) -> np.ndarray:
    out = inputs[0].copy()
    for part in inputs[1:]:
        ufunc(out, part, out=out)
    return out


def large_calls(comm: tcoll.Communicator, python_rank: int, lend_rank: int, calls: int,
                sizes: tuple[int, ...] = SIZES, kind: str = "reductions") -> tuple[list[str], dict]:
    """all_reduce and reduce (or broadcasts, or gathers) of `sizes` by turns, roots and a late rank by turns;
    (failures, kernel ends)."""
    counting = counted_kernel(comm, PieceCounting, python_rank)
    p, me, bad = comm.size, comm.rank, []
    for call in range(calls):
        dtype, op, ufunc = CASES[call % len(CASES)]
        count = sizes[call % len(sizes)] // np.dtype(dtype).itemsize
        inputs = [_input(q, call, count, dtype) for q in range(p)]
        x = comm.empty(count, dtype) if me == lend_rank else np.empty(count, dtype)
        x[...] = inputs[me]
        if me == (call // 2) % p:
            _busy(0.0003)
        if kind == "broadcasts":
            comm.broadcast(x, call % p, algorithm="shm")
            want = inputs[call % p]
        elif kind == "gathers":
            got = comm.gather(x, call % p, algorithm="shm")
            x, want = (got, np.stack(inputs)) if me == call % p else (x, inputs[me])
        elif call % 2 == 0:
            comm.all_reduce(x, op, algorithm="shm")
            want = _folded(ufunc, inputs)
        else:
            root = call % p
            comm.reduce(x, root, op, algorithm="shm")
            want = _folded(ufunc, inputs) if me == root else inputs[me]
        if not np.array_equal(x, want):
            name = kind if kind != "reductions" else "all_reduce" if call % 2 == 0 else "reduce"
            bad.append(f"rank {me}: call #{call} ({name} {op} {count} {np.dtype(dtype)}) differs from NumPy")
    return bad, dict(counting.ends)


@needs_kernel
@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("size", [2, 3, 4])
def test_pieces_in_the_kernel_match_numpy(size: int, kind: str) -> None:
    results = tcoll.spawn(large_calls, size, (-1, -1, 18, SIZES, kind), timeout=100, transport="shm", shm_slot=SLOT)
    assert not [f for bad, _ in results for f in bad], results
    if size == 2:  # (more ranks than cores: a call ends in the kernel only when every rank comes within its spin)
        assert all(ends.get("all") for _, ends in results), results


@needs_kernel
@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("python_rank", [0, 2])
def test_a_rank_in_python_pairs_with_ranks_in_the_kernel(python_rank: int, kind: str) -> None:
    results = tcoll.spawn(large_calls, 3, (python_rank, -1, 18, SIZES, kind), timeout=100, transport="shm",
                          shm_slot=SLOT)
    assert not [f for bad, _ in results for f in bad], results
    assert not results[python_rank][1], results  # (it never ran the kernel)


@needs_kernel
@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", KINDS)
def test_a_lent_buffer_stops_the_kernel_and_is_read_in_place(kind: str) -> None:
    """(Rank 1 lends; in a broadcast the others stop where it is root, in a gather its root does where it is not.)"""
    lending = (arena_module.ZERO_COPY_BYTES + 8, 5 * SLOT + 1000)  # (comm.empty buffers are lent from this size)
    results = tcoll.spawn(large_calls, 3, (-1, 1, 12, lending, kind), timeout=100, transport="shm", shm_slot=SLOT)
    assert not [f for bad, _ in results for f in bad], results
    if kind == "reductions":  # the first piece found a lender
        assert not any(ends.get("all") for _, ends in results), results
    else:
        assert all(ends.get("early") for rank, (_, ends) in enumerate(results) if rank != 1), results


def rank_zeros_pieces(comm: tcoll.Communicator, zero_shares_cores: bool) -> tuple[int, int, bool]:
    """Rank 0 counts the host's cores one way, the others the other; then large all_reduces with the default
    slot. (this rank's slot and piece, whether every result matched NumPy)."""
    engine = comm.core.engine
    engine.spin = SpinPolicy(engine.settings.spin_us, oversubscribed=zero_shares_cores == (comm.rank == 0))
    ok = True
    for call, nbytes in enumerate((SLOT_BYTES + 4096, 5 * PIECE_BYTES // 2 + 12, 3 * SLOT_BYTES - 8)):
        inputs = [_input(q, call, nbytes // 4, np.float32) for q in range(comm.size)]
        x = inputs[comm.rank].copy()
        comm.all_reduce(x, algorithm="shm")
        ok = ok and bool(np.array_equal(x, _folded(np.add, inputs)))
    arena = comm.core.dispatch.arena
    return arena.slot_bytes, arena.piece_bytes, ok


@needs_kernel
@pytest.mark.timeout(120)
@pytest.mark.parametrize("zero_shares_cores", [False, True])
def test_every_rank_takes_rank_zeros_pieces(zero_shares_cores: bool) -> None:
    """Pieces smaller than the slot (rank 0 gives every rank a core) or the whole slot (it sees them share)."""
    results = tcoll.spawn(rank_zeros_pieces, 2, (zero_shares_cores,), timeout=100, transport="shm")
    want = (SLOT_BYTES_SHARED, SLOT_BYTES_SHARED) if zero_shares_cores else (SLOT_BYTES, PIECE_BYTES)
    assert results == [(*want, True)] * 2, results


def differing(comm: tcoll.Communicator, sizes: tuple[int, int], name: str) -> tuple[str, bool]:
    """Rank 0 reduces (broadcasts, gathers) sizes[0] bytes where the others do sizes[1]; then a right call."""
    x = np.ones(sizes[0 if comm.rank == 0 else 1] // 4, np.float32)
    said = mismatch_said(lambda: comm.all_reduce(x, algorithm="shm") if name == "all_reduce" else
                         getattr(comm, name)(x, 1, algorithm="shm"))
    got = comm.all_gather(np.array([comm.rank]), algorithm="shm")
    return said, bool(np.array_equal(got.ravel(), np.arange(comm.size)))


@needs_kernel
@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", ["all_reduce", "broadcast", "gather"])
@pytest.mark.parametrize("sizes", [(2 * SLOT, 2 * SLOT + 64), (2 * SLOT, 4 * SLOT)])  # same pieces; more
def test_pieces_that_differ_raise_on_every_rank(sizes: tuple[int, int], name: str) -> None:
    results = tcoll.spawn(differing, 3, (sizes, name), timeout=50, transport="shm", shm_slot=SLOT)
    assert_every_rank_raised(results, sizes)


def differing_root_or_op(comm: tcoll.Communicator, name: str) -> tuple[str, bool]:
    """Rank 2 names another root (or, in an all_reduce, another op) than the others; then a right call."""
    x = np.ones(3 * SLOT // 4, np.float32)
    odd = comm.rank == 2
    said = mismatch_said(lambda: comm.all_reduce(x, "max" if odd else "sum", algorithm="shm") if name == "all_reduce"
                         else getattr(comm, name)(x, 2 if odd else 0, algorithm="shm"))
    got = comm.all_gather(np.array([comm.rank]), algorithm="shm")
    return said, bool(np.array_equal(got.ravel(), np.arange(comm.size)))


@needs_kernel
@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", ["all_reduce", "broadcast", "gather"])
def test_pieces_whose_root_or_op_differs_raise_on_every_rank(name: str) -> None:
    """(Rank 2 writes as a root where the others read from rank 0: its data must not pass for rank 0's.)"""
    results = tcoll.spawn(differing_root_or_op, 3, (name,), timeout=50, transport="shm", shm_slot=SLOT)
    assert_every_rank_raised(results, name)


# -- word by word: the test plays rank 1 of 2 on FakeArena's memory (4 KiB slots, 4 KiB pieces) ----------------

PIECE = FakeArena.SLOT
N = (2 * PIECE - 400) // 4  # float32: a piece of 1024 items, then one of 924 (rank 0 owns 512, then 462)


def _pieces(fake: FakeArena, buf: np.ndarray, done: int, want: bool = True) -> int:
    code = arena_module.KERNEL_DTYPES[buf.dtype]
    return fake.kernel.run_pieces(buf, code, 0, 0, STAMP, 7, 0, False, want, PIECE, done)


def _describe(fake: FakeArena, sequence: int = 7, lent: int = 0) -> None:
    fake.desc[8:12] = [STAMP & (2**64 - 1), STAMP >> 64, sequence, lent]  # rank 1's descriptor of step 0


@needs_kernel
def test_each_phase_writes_and_waits_where_the_python_steps_do() -> None:
    fake = FakeArena()
    mine = np.arange(N, dtype=np.float32)
    peer = np.arange(N, dtype=np.float32) * 10 + 1
    buf = mine.copy()
    assert _pieces(fake, buf, 0) == 1  # input published; the peer has not: the reduction waits
    assert fake.counters[0] == 1 and np.array_equal(fake.slot(0, 0, np.float32, 1024)[512:], mine[512:1024])
    assert np.array_equal(buf, mine)
    _describe(fake)
    fake.slot(1, 0, np.float32, 512)[...] = peer[:512]  # the peer's input for rank 0's part
    fake.counters[1] = 1
    assert _pieces(fake, buf, 1) == 2  # rank 0's part reduced, into its buffer and its slot of step 1
    assert fake.counters[0] == 2 and np.array_equal(buf[:512], mine[:512] + peer[:512])
    assert np.array_equal(fake.slot(0, 1, np.float32, 512), mine[:512] + peer[:512])
    fake.slot(1, 1, np.float32, 1024)[512:] = 5.0  # the peer's reduced part
    fake.counters[1] = 2
    assert _pieces(fake, buf, 2) == 4  # copied out; the second piece's input published (step 2, set 0)
    assert np.array_equal(buf[512:1024], np.full(512, 5.0, np.float32)) and fake.counters[0] == 3
    assert np.array_equal(fake.slot(0, 2, np.float32, 924)[462:], mine[1024 + 462:])
    fake.slot(1, 2, np.float32, 462)[...] = peer[1024:1024 + 462]
    fake.counters[1] = 3
    assert _pieces(fake, buf, 4) == 5 and fake.counters[0] == 4
    fake.slot(1, 3, np.float32, 924)[462:] = 6.0
    fake.counters[1] = 4
    assert _pieces(fake, buf, 5) == 6  # all six phases
    want = np.concatenate([mine[:512] + peer[:512], np.full(512, 5.0), mine[1024:1024 + 462] + peer[1024:1024 + 462],
                           np.full(462, 6.0)]).astype(np.float32)
    assert np.array_equal(buf, want)


@needs_kernel
def test_a_rank_that_wants_no_result_does_not_wait_for_the_others_parts() -> None:
    fake = FakeArena()
    buf = np.ones(N, dtype=np.float32)
    assert _pieces(fake, buf, 0, want=False) == 1
    _describe(fake)
    fake.counters[1] = 1
    assert _pieces(fake, buf, 1, want=False) == 3  # reduced into its slot only; no copy out, but the next
    assert np.array_equal(buf, np.ones(N, dtype=np.float32)) and fake.counters[0] == 2  # piece's slots: in use
    fake.counters[1] = 2  # the peer published its part (and so is done reading step 0)
    assert _pieces(fake, buf, 3, want=False) == 4 and fake.counters[0] == 3


@needs_kernel
@pytest.mark.parametrize(("sequence", "lent"), [(8, 0), (7, 1)], ids=["another call", "a lender"])
def test_the_first_piece_is_left_to_python_where_the_peer_differs_or_lent(sequence: int, lent: int) -> None:
    fake = FakeArena()
    buf = np.ones(N, dtype=np.float32)
    assert _pieces(fake, buf, 0) == 1
    _describe(fake, sequence, lent)
    fake.counters[1] = 1
    assert _pieces(fake, buf, 1) == 1  # nothing reduced: Python raises MismatchError, or reads the lender
    assert fake.counters[0] == 1 and np.array_equal(buf, np.ones(N, dtype=np.float32))


def _broadcast_pieces(fake: FakeArena, buf: np.ndarray, root: int, done: int) -> int:
    return fake.kernel.run_broadcast_pieces(buf, root, 0, STAMP, 7, 0, False, done)


@needs_kernel
def test_a_broadcasting_root_streams_each_piece_once_every_rank_is_done_with_its_slot_set() -> None:
    fake = FakeArena()
    data = (np.arange(PIECE + 1000) % 251).astype(np.uint8)
    assert _broadcast_pieces(fake, data, 0, 0) == 1  # piece 0 written and published; the check waits
    assert fake.progress(0).tolist() == [1, PIECE] and fake.counters[0] == 1
    assert np.array_equal(fake.slot(0, 0, np.uint8, PIECE), data[:PIECE])
    _describe(fake)
    fake.counters[1] = 1  # the peer describes the same call and publishes step 0 at once
    assert _broadcast_pieces(fake, data, 0, 1) == 4 and fake.counters[0] == 2
    assert fake.progress(0).tolist() == [2, 1000]
    assert np.array_equal(fake.slot(0, 1, np.uint8, 1000), data[PIECE:])


@needs_kernel
def test_a_broadcast_reader_copies_what_root_announced_and_resumes_piece_by_piece() -> None:
    fake = FakeArena()
    data = (np.arange(PIECE + 1000) % 251).astype(np.uint8)
    out = np.zeros_like(data)
    _describe(fake)
    fake.slot(1, 0, np.uint8, PIECE)[...] = data[:PIECE]
    fake.progress(1)[:] = [1, PIECE // 2]  # root (rank 1) announced half of piece 0, and stalls
    assert _broadcast_pieces(fake, out, 1, 0) == 1 and fake.counters[0] == 1
    assert np.array_equal(out[:PIECE // 2], data[:PIECE // 2]) and not out[PIECE // 2:].any()
    fake.counters[1] = 1  # root published piece 0
    assert _broadcast_pieces(fake, out, 1, 1) == 3  # piece 0 copied and checked; step 1 published; waits
    assert np.array_equal(out[:PIECE], data[:PIECE]) and fake.counters[0] == 2
    fake.slot(1, 1, np.uint8, 1000)[...] = data[PIECE:]
    fake.counters[1] = 2
    assert _broadcast_pieces(fake, out, 1, 3) == 4 and np.array_equal(out, data)


@needs_kernel
def test_a_broadcast_reader_leaves_a_lent_root_buffer_to_python() -> None:
    fake = FakeArena()
    out = np.zeros(PIECE + 1000, np.uint8)
    _describe(fake, lent=1)
    fake.counters[1] = 1
    assert _broadcast_pieces(fake, out, 1, 0) == 1 and not out.any()


@needs_kernel
def test_a_gathering_root_copies_each_block_into_place_as_its_writer_announces_it() -> None:
    fake = FakeArena()
    block = (np.arange(PIECE + 1000) % 251).astype(np.uint8)
    mine, out = np.zeros_like(block), np.zeros(2 * block.size, np.uint8)
    gather = fake.kernel.run_gather_pieces
    _describe(fake)
    fake.slot(1, 0, np.uint8, PIECE)[...] = block[:PIECE]
    fake.progress(1)[:] = [1, PIECE // 2]  # rank 1 announced half of its first piece
    assert gather(mine, out, 0, 0, STAMP, 7, 0, False, 0) == 1 and fake.counters[0] == 1
    assert np.array_equal(out[block.size:block.size + PIECE // 2], block[:PIECE // 2])
    fake.counters[1] = 1
    assert gather(mine, out, 0, 0, STAMP, 7, 0, False, 1) == 3 and fake.counters[0] == 2  # waits for piece 1
    fake.slot(1, 1, np.uint8, 1000)[...] = block[PIECE:]
    fake.counters[1] = 2
    assert gather(mine, out, 0, 0, STAMP, 7, 0, False, 3) == 4
    assert np.array_equal(out[block.size:], block) and not out[:block.size].any()  # (root's own: the caller's)


@needs_kernel
def test_a_gathered_rank_streams_its_pieces_and_waits_for_root_before_reusing_a_slot_set() -> None:
    fake = FakeArena()  # rank 0 writes, rank 1 is root
    block = (np.arange(2 * PIECE + 100) % 251).astype(np.uint8)  # three pieces
    gather = fake.kernel.run_gather_pieces
    assert gather(block, None, 1, 0, STAMP, 7, 0, False, 0) == 1  # piece 0 streamed and published
    assert fake.progress(0).tolist() == [1, PIECE] and np.array_equal(fake.slot(0, 0, np.uint8, PIECE), block[:PIECE])
    _describe(fake)
    fake.counters[1] = 1  # root published step 0 (done with nothing before it)
    assert gather(block, None, 1, 0, STAMP, 7, 0, False, 1) == 4  # checked; piece 1 written; piece 2 must wait
    assert fake.counters[0] == 2 and np.array_equal(fake.slot(0, 1, np.uint8, PIECE), block[PIECE:2 * PIECE])
    assert np.array_equal(fake.slot(0, 0, np.uint8, PIECE), block[:PIECE])  # set 0 still root's to read
    fake.counters[1] = 2  # root is done with piece 0
    assert gather(block, None, 1, 0, STAMP, 7, 0, False, 4) == 6 and fake.counters[0] == 3
    assert np.array_equal(fake.slot(0, 2, np.uint8, 100), block[2 * PIECE:])


@needs_kernel
def test_rooted_readers_leave_a_writer_that_describes_another_call_to_python() -> None:
    fake = FakeArena()
    out, mine = np.zeros(PIECE + 1000, np.uint8), np.zeros(PIECE + 1000, np.uint8)
    _describe(fake, sequence=8)  # rank 1 is at another call
    fake.slot(1, 0, np.uint8, PIECE)[...] = 9
    fake.counters[1] = 1
    assert _broadcast_pieces(fake, out, 1, 0) == 1 and not out.any()  # as a broadcast's reader
    gathered = np.zeros(2 * mine.size, np.uint8)
    assert fake.kernel.run_gather_pieces(mine, gathered, 0, 0, STAMP, 7, 0, False, 1) == 1  # as a gather's root
    assert not gathered.any()


def thread_ranks(comm: tcoll.Communicator) -> list[str]:
    """Broadcasts and gathers larger than a slot between threads of one process (the kernel lets the GIL go)."""
    return large_calls(comm, -1, -1, 12, SIZES, "broadcasts")[0] + large_calls(comm, -1, -1, 12, SIZES, "gathers")[0]


@needs_kernel
@pytest.mark.timeout(120)
def test_rooted_pieces_between_thread_ranks_match_numpy() -> None:
    results = tcoll.spawn(thread_ranks, 3, threads=True, timeout=100, transport="shm", shm_slot=SLOT)
    assert results == [[], [], []], results
