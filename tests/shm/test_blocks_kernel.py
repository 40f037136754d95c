"""The block collectives' one step in C (Kernel.run_blocks) against NumPy: all_gather, gather, all_to_all,
reduce_scatter.

On real ranks: every collective through the kernel's one step, with ranks
late by turns (a late peer hands the wait to Python), with one rank running
the Python steps beside ranks in C (the slots are laid out alike), and with
sizes on either side of the one step; ranks that disagree all raise. On an
arena's memory in this process, where the test plays the peer: the layout the
kernel publishes, the result it copies or reduces out, and what it leaves to
Python (a peer that has not published, a descriptor that differs).
"""

from __future__ import annotations

import time
from typing import Any

import ml_dtypes
import numpy as np
import pytest

import tcoll
from tcoll.shm import arena as arena_module

from helpers.fake_arena import STAMP, CountingKernel, FakeArena
from helpers.mismatch import assert_every_rank_raised, mismatch_said

pytestmark = pytest.mark.usefixtures("no_leftovers")
needs_kernel = pytest.mark.skipif(arena_module.kernel_module is None, reason="the C kernel is not built")
K = arena_module.kernel_module
SLOT = "64K"  # blocks of a few KiB take one step; 40 KiB blocks of an all_to_all on 2 ranks take two
COLLECTIVES = ("all_gather", "gather", "all_to_all", "reduce_scatter")


def _busy(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def _block(rank: int, call: int, count: int, dtype: np.dtype) -> np.ndarray:
    """Rank `rank`'s input of call `call`: size blocks of `count` items, distinct everywhere."""
    size = 64
    values = (np.arange(size * count) * 7 + rank * 1000 + call * 13) % 251
    return values.astype(dtype)


def call_and_expect(comm: tcoll.Communicator, name: str, x: np.ndarray, inputs: list[np.ndarray],
                    root: int) -> tuple[Any, np.ndarray | None]:
    """Call `name` (shm) with this rank's blocks `x` (every rank's are `inputs`); (its result, NumPy's)."""
    p, me = comm.size, comm.rank
    if name == "all_gather":
        return comm.all_gather(x[0], algorithm="shm"), np.stack([inputs[q][0] for q in range(p)])
    if name == "gather":
        return (comm.gather(x[0], root=root, algorithm="shm"),
                np.stack([inputs[q][0] for q in range(p)]) if me == root else None)
    if name == "all_to_all":
        return comm.all_to_all(x, algorithm="shm"), np.stack([inputs[q][me] for q in range(p)])
    total = inputs[0].copy()
    for q in range(1, p):
        total += inputs[q]
    return comm.reduce_scatter(x, "sum", algorithm="shm"), total[me:me + 1]


def one_call(comm: tcoll.Communicator, name: str, call: int, count: int, dtype: np.dtype, root: int) -> str | None:
    """One `name` call on `count` items per block against NumPy; a failure's description, or None."""
    p, me = comm.size, comm.rank
    inputs = [_block(q, call, count, dtype)[:p * count].reshape(p, count) for q in range(p)]
    got, want = call_and_expect(comm, name, inputs[me], inputs, root)
    if want is None:
        return None if got is None else f"{name} gave {type(got)} off root"
    if got.dtype != want.dtype or not np.array_equal(got, want):
        return f"rank {me}: {name} #{call} {dtype} x{count} root {root}"
    return None


def every_collective(comm: tcoll.Communicator, kernel_on_rank_1: bool, calls: int) -> tuple[list[str], dict[int, int]]:
    """`calls` block collectives of each kind, with a rank late by turns; (failures, kernel states seen)."""
    comm.barrier(algorithm="shm")  # makes the arena
    arena = comm.core.dispatch.arena
    counting = CountingKernel(arena.kernel)
    arena.kernel = None if (comm.rank == 1 and not kernel_on_rank_1) else counting
    rng = np.random.default_rng(5)  # the same draws on every rank
    bad = []
    for call in range(calls):
        name = COLLECTIVES[call % len(COLLECTIVES)]
        count = int(rng.choice([1, 3, 500, 1000 if name == "all_gather" else 5000]))
        dtype = np.dtype(rng.choice([np.float32, np.int64, np.uint8, ml_dtypes.bfloat16]))
        root, late = int(rng.integers(0, comm.size)), int(rng.integers(0, comm.size))
        if comm.rank == late:
            _busy(0.0003)
        failure = one_call(comm, name, call, count, dtype, root)
        if failure:
            bad.append(failure)
    return bad, dict(counting.states)


@needs_kernel
@pytest.mark.timeout(120)
@pytest.mark.parametrize("size", [2, 3, 4])
def test_block_collectives_in_the_kernel_match_numpy(size: int) -> None:
    """Every block collective, one step in C (and across it: blocks larger than a slot's share), right."""
    results = tcoll.spawn(every_collective, size, (True, 48), timeout=100, transport="shm", shm_slot=SLOT)
    assert not [f for bad, _ in results for f in bad], results
    if size == 2:  # (more ranks than cores: a call finishes in the kernel only when every rank comes within the spin)
        assert all(states.get(K.DONE) for _, states in results), results
    else:
        assert any(states.get(K.DONE) or states.get(K.PUBLISHED) for _, states in results), results


@needs_kernel
@pytest.mark.timeout(120)
@pytest.mark.parametrize("size", [2, 3])
def test_ranks_with_and_without_the_kernel_pair(size: int) -> None:
    """Rank 1 runs the Python steps, the others the kernel: the same layout, the same results."""
    results = tcoll.spawn(every_collective, size, (False, 48), timeout=100, transport="shm", shm_slot=SLOT)
    assert not [f for bad, _ in results for f in bad], results
    assert results[0][1].get(K.DONE) and not results[1][1], results


def late_peer(comm: tcoll.Communicator, calls: int) -> tuple[bool, int]:
    """all_gather with the last rank late (1 ms and more) until rank 0's kernel handed a wait over."""
    comm.barrier(algorithm="shm")
    arena = comm.core.dispatch.arena
    counting = arena.kernel = CountingKernel(arena.kernel)
    ok, delay = True, 0.001
    for call in range(calls):
        if comm.rank == comm.size - 1:
            _busy(delay)
        got = comm.all_gather(np.full(3, comm.rank + call, dtype=np.int32), algorithm="shm")
        ok &= bool(np.array_equal(got, np.repeat(np.arange(comm.size)[:, None] + call, 3, axis=1)))
        waited = np.array([counting.states.get(K.PUBLISHED, 0) if comm.rank == 0 else 0])
        comm.all_reduce(waited, algorithm="ring")
        if waited[0] >= 3:
            break
        delay = min(2 * delay, 0.064)
    return ok, counting.states.get(K.PUBLISHED, 0)


@needs_kernel
@pytest.mark.timeout(60)
def test_a_late_peer_hands_the_wait_to_python() -> None:
    results = tcoll.spawn(late_peer, 3, (40,), timeout=50, transport="shm")
    assert all(ok for ok, _ in results), results
    assert results[0][1] > 0, results


def disagree(comm: tcoll.Communicator, name: str) -> tuple[str, bool]:
    """Rank 0 passes blocks of another length (or another root) than the others; then a right call."""
    first = comm.rank == 0
    count = 4 if first else 5
    calls = {"gather root": lambda: comm.gather(np.ones(3, np.float32), root=0 if first else 1, algorithm="shm"),
             "all_gather": lambda: comm.all_gather(np.ones(count, np.float32), algorithm="shm"),
             "all_to_all": lambda: comm.all_to_all(np.ones((comm.size, count), np.float32), algorithm="shm"),
             "reduce_scatter": lambda: comm.reduce_scatter(np.ones((comm.size, count), np.float32), algorithm="shm")}
    said = mismatch_said(calls[name])
    got = comm.all_gather(np.array([comm.rank]), algorithm="shm")
    return said, bool(np.array_equal(got.ravel(), np.arange(comm.size)))


@needs_kernel
@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", ["all_gather", "all_to_all", "reduce_scatter", "gather root"])
def test_ranks_that_disagree_all_raise(name: str) -> None:
    results = tcoll.spawn(disagree, 3, (name,), timeout=50, transport="shm")
    assert_every_rank_raised(results, name)


def _run(fake: FakeArena, send: np.ndarray, out: np.ndarray | None, kind: int, block: int, root: int = 0,
         codes: tuple[int, int] = (0, 0), stamp: int = STAMP, step: int = 0, lending: bool = False) -> int:
    return fake.kernel.run_blocks(send, out, kind, block, root, *codes, lending, step, stamp, 7, 0, False)


@needs_kernel
def test_the_kernel_lays_blocks_out_as_python_and_hands_over() -> None:
    """Rank 1 silent: rank 0's all_to_all blocks for others lie at q * share of its slot, its own does not
    go there; the step is published and the wait is Python's."""
    fake = FakeArena()
    share = fake.SLOT // 2
    send, out = np.arange(8, dtype=np.uint8), np.zeros(8, np.uint8)
    assert _run(fake, send, out, K.BLOCKS_ALL_TO_ALL, 4) == K.PUBLISHED
    slot = fake.slot(0, 0, np.uint8, fake.SLOT)
    assert slot[share:share + 4].tolist() == [4, 5, 6, 7] and not slot[:4].any()
    assert fake.counters.tolist() == [1, 0] and fake.desc[:4].tolist() == [0xBEEF, 0xFEED, 7, 0]
    assert not out.any()


@needs_kernel
def test_the_kernel_copies_and_reduces_out_once_every_rank_agrees() -> None:
    fake = FakeArena()
    share = fake.SLOT // 2
    peer = np.zeros(fake.SLOT, np.uint8)
    peer[:4] = [9, 9, 9, 9]  # an all_gather's block heads its slot
    fake.peer_publishes(0, STAMP, 7, peer)
    out = np.zeros(8, np.uint8)
    assert _run(fake, np.arange(4, dtype=np.uint8), out, K.BLOCKS_ALL_GATHER, 4) == K.DONE
    assert out.tolist() == [0, 1, 2, 3, 9, 9, 9, 9]
    theirs = np.zeros(fake.SLOT // 4, np.int32)  # a reduce_scatter's blocks: rank 0's part at 0 of every slot
    theirs[:2] = [100, 200]
    fake.peer_publishes(1, STAMP, 7, theirs)
    part = np.zeros(2, np.int32)
    codes = (arena_module.KERNEL_DTYPES[np.dtype(np.int32)], 0)
    assert _run(fake, np.array([1, 2, 3, 4], np.int32), part.view(np.uint8), K.BLOCKS_REDUCE_SCATTER, 8, 0,
                codes, step=1) == K.DONE
    assert part.tolist() == [101, 202]
    assert fake.slot(0, 1, np.int32, share // 4 + 2)[share // 4:].tolist() == [3, 4]  # rank 1's block, at share


@needs_kernel
def test_the_kernel_leaves_a_differing_descriptor_to_python() -> None:
    fake = FakeArena()
    fake.peer_publishes(0, STAMP + 1, 7, np.full(4, 9, np.uint8))
    out = np.zeros(8, np.uint8)
    assert _run(fake, np.arange(4, dtype=np.uint8), out, K.BLOCKS_ALL_GATHER, 4) == K.PUBLISHED
    assert not out.any()


@needs_kernel
def test_the_kernel_refuses_blocks_that_do_not_fit_one_step() -> None:
    fake = FakeArena()
    with pytest.raises(ValueError, match="do not fit"):
        _run(fake, np.zeros(fake.SLOT + 1, np.uint8), np.zeros(2 * fake.SLOT + 2, np.uint8), K.BLOCKS_ALL_GATHER,
             fake.SLOT + 1)
    with pytest.raises(ValueError, match="do not fit"):  # an output of the wrong length
        _run(fake, np.zeros(4, np.uint8), np.zeros(7, np.uint8), K.BLOCKS_ALL_GATHER, 4)
    with pytest.raises(ValueError, match="do not fit"):  # all_to_all blocks past a slot's share
        _run(fake, np.zeros(fake.SLOT + 2, np.uint8), np.zeros(fake.SLOT + 2, np.uint8), K.BLOCKS_ALL_TO_ALL,
             fake.SLOT // 2 + 1)
    assert fake.counters.tolist() == [0, 0]  # nothing published


@needs_kernel
def test_a_call_large_enough_to_lend_takes_the_lenders_step_too() -> None:
    """Lending: once done, the kernel publishes the lenders' step as well (it lent nothing: no wait); a peer
    whose descriptor says it lent its buffer leaves the call to Python (PUBLISHED, nothing copied)."""
    fake = FakeArena()
    fake.peer_publishes(0, STAMP, 7, np.full(4, 9, np.uint8))
    out = np.zeros(8, np.uint8)
    assert _run(fake, np.arange(4, dtype=np.uint8), out, K.BLOCKS_GATHER, 4, 0, lending=True) == K.DONE
    assert out.tolist() == [0, 1, 2, 3, 9, 9, 9, 9] and fake.counters[0] == 2  # steps 0 and 1 published
    fake.peer_publishes(2, STAMP, 7, np.full(4, 5, np.uint8))
    fake.desc[((2 % 2) * 2 + 1) * 8 + 3] = 12345  # the peer lent a buffer for this call
    out[...] = 0
    assert _run(fake, np.arange(4, dtype=np.uint8), out, K.BLOCKS_GATHER, 4, 0, step=2, lending=True) == K.PUBLISHED
    assert not out.any() and fake.counters[0] == 3  # its own step published, not the lenders'


def lenders_and_not(comm: tcoll.Communicator, calls: int) -> tuple[list[str], dict[int, int]]:
    """Calls large enough to lend (64 KiB and more in all), with no rank's input, one rank's or every rank's in
    shared memory (lent: that rank takes the Python steps; the others the kernel's step, which leaves a call a
    peer lent in to Python): NumPy's results, whatever mix."""
    comm.barrier(algorithm="shm")
    arena = comm.core.dispatch.arena
    counting = arena.kernel = CountingKernel(arena.kernel)
    p, me, bad = comm.size, comm.rank, []
    for call in range(calls):
        name = ("gather", "all_to_all", "reduce_scatter")[call % 3]
        count = 8192 + 1000 * (call % 4)  # float32: 32-44 KiB per block, 64 KiB and more in all
        inputs = [((np.arange(p * count) * (q + 1) + call) % 97).astype(np.float32).reshape(p, count)
                  for q in range(p)]
        lent = (False, me == call % p, True)[call // 3 % 3]  # nobody, one rank, everybody lends
        x = comm.empty((p, count), np.float32) if lent else np.empty((p, count), np.float32)
        x[...] = inputs[me]
        got, want = call_and_expect(comm, name, x, inputs, call % p)
        if (want is None) != (got is None) or (want is not None and not np.array_equal(got, want)):
            bad.append(f"rank {me} call {call}: {name} x{count} lent {lent}")
    return bad, dict(counting.states)


@needs_kernel
@pytest.mark.timeout(120)
@pytest.mark.parametrize("size", [2, 3])
def test_calls_large_enough_to_lend_pair_lenders_with_the_kernel(size: int) -> None:
    results = tcoll.spawn(lenders_and_not, size, (27,), timeout=100, transport="shm")
    assert not [f for bad, _ in results for f in bad], results
    assert any(states.get(K.PUBLISHED) for _, states in results), results  # (a peer lent: whatever the timing)
    if size == 2:  # (more ranks than cores: a call finishes in the kernel only when every rank comes within the spin)
        assert all(states.get(K.DONE) for _, states in results), results  # (nobody lent)
