"""The arena's small reduction step in C (tcoll/shm/_arena_kernel.c) against NumPy, and where it hands over to Python.

Every dtype and op the kernel takes, with the values where C and NumPy could
part ways (NaN, signed zeros, infinities, integers that wrap), on 2, 3 and 4
process ranks, for all_reduce and reduce, with the kernel and without it
(the Python steps); the expected result is NumPy's ufunc folded over the
ranks' inputs in rank order. Then the hand-overs, on real ranks (a peer later
than the kernel's spin: the step is published and Python waits; ranks that
disagree on the op: every rank raises, as in Python) and, word by word, on an
arena's memory in this process where the test plays the peer (a step whose
slots are still in use is not started; a differing descriptor is not reduced;
a sleeping peer is rung).
"""

from __future__ import annotations

import time

import ml_dtypes
import numpy as np
import pytest

import tcoll
from tcoll.shm import arena as arena_module

from helpers.fake_arena import STAMP, CountingKernel, FakeArena
from helpers.mismatch import assert_every_rank_raised, mismatch_said

pytestmark = pytest.mark.usefixtures("no_leftovers")
needs_kernel = pytest.mark.skipif(arena_module.kernel_module is None, reason="the C kernel is not built")

BFLOAT16 = np.dtype(ml_dtypes.bfloat16)
SLOT = "64K"  # the ranks' arena slot: calls larger than it take the pipelined steps
PIPELINED = 3 * 65536 + 1000  # bytes: four pieces, the last one short
SPLIT = 40_000  # bytes: on 2 ranks, a call that fits the slot in three steps (each rank reduces half)
WIDE_SLOT, WIDE_SPLIT = "256K", 200_000  # the same on more ranks (above the 128 KiB of one step)
UFUNCS = {"sum": np.add, "prod": np.multiply, "min": np.minimum, "max": np.maximum,
          "band": np.bitwise_and, "bor": np.bitwise_or, "bxor": np.bitwise_xor, "avg": np.add}


def _counting(comm: tcoll.Communicator) -> CountingKernel:
    comm.barrier(algorithm="shm")  # makes the arena
    arena = comm.core.dispatch.arena
    assert arena.kernel is not None
    arena.kernel = CountingKernel(arena.kernel)
    return arena.kernel


def _floating(dtype: np.dtype) -> bool:
    return dtype.kind == "f" or dtype == BFLOAT16


def _inputs(rank: int, dtype: np.dtype, count: int, salt: int) -> np.ndarray:
    """Rank `rank`'s input: special values where the dtype has them, the rest seeded."""
    rng = np.random.default_rng(1000 * rank + salt)
    if _floating(dtype):
        specials = np.array([np.nan, -0.0, 0.0, np.inf, -np.inf, 1e30, -1e-30, 3.5], dtype=dtype)
        values = (rng.standard_normal(count) * 100).astype(dtype)
        values[: min(count, 8)] = np.roll(specials, rank)[: min(count, 8)]
        return values
    info = np.iinfo(dtype)
    values = rng.integers(info.min, info.max, size=count, dtype=dtype, endpoint=True)
    values[: min(count, 3)] = np.array([info.max, info.min, -1 if info.min < 0 else 1], dtype=dtype)[: min(count, 3)]
    return values


def _expected(op: str, inputs: list[np.ndarray]) -> np.ndarray:
    out = inputs[0].copy()
    with np.errstate(all="ignore"):
        for part in inputs[1:]:
            UFUNCS[op](out, part, out=out)
        if op == "avg":
            np.true_divide(out, out.dtype.type(len(inputs)), out=out)
    return out


def _same(got: np.ndarray, want: np.ndarray) -> bool:
    """Equal element by element, NaN where NaN, and the sign of every number (zeros too) but NaN's."""
    if not _floating(got.dtype):
        return bool(np.array_equal(got, want))
    got, want = got.astype(np.float64), want.astype(np.float64)  # exact for every float dtype here
    numbers = ~np.isnan(want)
    return bool(np.array_equal(got, want, equal_nan=True)
                and np.array_equal(np.signbit(got[numbers]), np.signbit(want[numbers])))


def every_dtype_and_op(comm: tcoll.Communicator, use_kernel: bool,
                       sizes: tuple[int, ...]) -> tuple[list[str], dict[int, int]]:
    """all_reduce and reduce of every kernel dtype and op, `sizes` bytes each, against NumPy; (failures,
    kernel states seen)."""
    counting = _counting(comm) if use_kernel else None
    if not use_kernel:
        comm.barrier(algorithm="shm")
        assert comm.core.dispatch.arena.kernel is None
    bad = []
    for dtype in arena_module.KERNEL_DTYPES:
        ops = ["sum", "prod", "min", "max"] + (["avg"] if _floating(dtype) else ["band", "bor", "bxor"])
        for op in ops:
            for count in [max(1, n // dtype.itemsize) for n in sizes]:
                salt = count + len(op)
                inputs = [_inputs(q, dtype, count, salt) for q in range(comm.size)]
                with np.errstate(all="ignore"):
                    x = inputs[comm.rank].copy()
                    comm.all_reduce(x, op, algorithm="shm")
                    if not _same(x, _expected(op, inputs)):
                        bad.append(f"rank {comm.rank}: all_reduce {op} {dtype} x{count}")
                    root = count % comm.size
                    if op != "avg":
                        y = inputs[comm.rank].copy()
                        comm.reduce(y, root, op, algorithm="shm")
                        want = _expected(op, inputs) if comm.rank == root else inputs[comm.rank]
                        if not _same(y, want):
                            bad.append(f"rank {comm.rank}: reduce {op} {dtype} x{count} root {root}")
    return bad, dict(counting.states) if counting is not None else {}


@needs_kernel
@pytest.mark.timeout(180)
@pytest.mark.parametrize("use_kernel", [True, False], ids=["kernel", "python"])
@pytest.mark.parametrize("size", [2, 3, 4])
def test_every_dtype_and_op_matches_numpy(size: int, use_kernel: bool) -> None:
    """The kernel (and the Python steps it stands for) give NumPy's results bit for bit, in rank order: in the
    one step of small calls, the three steps of a call that fits a slot (2 ranks), and the pieces of the
    pipelined steps (the C kernel's combine)."""
    sizes = (1, 37 * 8, 16384, SPLIT, PIPELINED)
    results = tcoll.spawn(every_dtype_and_op, size, (use_kernel, sizes), timeout=160, transport="shm",
                          shm_slot=SLOT, shm_kernel="auto" if use_kernel else "off")
    assert not [f for bad, _ in results for f in bad], results
    if use_kernel:  # the kernel ran the calls (each took one of its three ways)
        assert all(sum(states.values()) > 0 for _, states in results), results


@needs_kernel
@pytest.mark.timeout(180)
@pytest.mark.parametrize("size", [3, 4])
def test_three_steps_on_more_ranks_match_numpy(size: int) -> None:
    """A call that fits a wider slot, above the one step's 128 KiB: the kernel's three steps on 3 and 4 ranks."""
    results = tcoll.spawn(every_dtype_and_op, size, (True, (WIDE_SPLIT,)), timeout=160, transport="shm",
                          shm_slot=WIDE_SLOT)
    assert not [f for bad, _ in results for f in bad], results
    assert all(states.get(arena_module.kernel_module.DONE) for _, states in results), results


def mixed_kernels(comm: tcoll.Communicator, calls: int) -> list[str]:
    """Rank 1 runs the Python steps while the others run the kernel: the same steps, the same results,
    through one step, three steps and the pipelined pieces, with ranks late by turns."""
    comm.barrier(algorithm="shm")  # makes the arena
    if comm.rank == 1:
        comm.core.dispatch.arena.kernel = None
    rng = np.random.default_rng(11)  # the same sequence on every rank
    bad = []
    for call in range(calls):
        count = int(rng.choice([3, 3000, SPLIT // 4 + 1, PIPELINED // 4]))
        op = str(rng.choice(["sum", "max", "prod"]))
        root, late = int(rng.integers(0, comm.size)), int(rng.integers(0, comm.size))
        inputs = [((np.arange(count) * (q + 2) + call) % 7 + 1).astype(np.float32) for q in range(comm.size)]
        if comm.rank == late:
            _busy(0.0002)
        x = inputs[comm.rank].copy()
        if call % 2:
            comm.reduce(x, root, op, algorithm="shm")
            want = _expected(op, inputs) if comm.rank == root else inputs[comm.rank]
        else:
            comm.all_reduce(x, op, algorithm="shm")
            want = _expected(op, inputs)
        if not _same(x, want):
            bad.append(f"rank {comm.rank} call {call}: {op} x{count} root {root}")
    return bad


@needs_kernel
@pytest.mark.timeout(120)
@pytest.mark.parametrize("size", [2, 3])
def test_ranks_with_and_without_the_kernel_take_the_same_steps(size: int) -> None:
    results = tcoll.spawn(mixed_kernels, size, (80,), timeout=100, transport="shm", shm_slot=SLOT)
    assert not [f for bad in results for f in bad], results


def _busy(seconds: float) -> None:
    """Keep this rank busy (not asleep) for `seconds`: it is late to the next call by that much."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def late_peer(comm: tcoll.Communicator, calls: int) -> tuple[bool, dict[int, int]]:
    """all_reduce where the last rank comes late (1 ms, far past the kernel's spin) until rank 0 has waited.

    On a loaded host rank 0 may itself be descheduled for longer than the last
    rank's delay; the delay then doubles (up to 64 ms) until rank 0 saw its
    kernel hand a wait over, which the ranks agree on after every call.
    """
    counting = _counting(comm)
    ok, delay = True, 0.001
    for call in range(calls):
        if comm.rank == comm.size - 1:
            _busy(delay)
        x = np.full(5, float(comm.rank + call), dtype=np.float64)
        comm.all_reduce(x, algorithm="shm")
        ok &= bool(np.array_equal(x, np.full(5, sum(q + call for q in range(comm.size)), dtype=np.float64)))
        waited = np.array([counting.states.get(arena_module.kernel_module.PUBLISHED, 0) if comm.rank == 0 else 0])
        comm.all_reduce(waited, algorithm="ring")  # not through the arena, so not counted
        if waited[0] >= 3:
            break
        delay = min(2 * delay, 0.064)
    return ok, dict(counting.states)


@needs_kernel
@pytest.mark.timeout(60)
def test_a_late_peer_hands_the_wait_to_python() -> None:
    """The early ranks publish in C and wait in Python (PUBLISHED); results stay right."""
    results = tcoll.spawn(late_peer, 3, (40,), timeout=50, transport="shm")
    assert all(ok for ok, _ in results), results
    assert results[0][1].get(arena_module.kernel_module.PUBLISHED, 0) > 0, results




@needs_kernel
def test_kernel_publishes_and_hands_over_when_the_peer_has_not() -> None:
    """Rank 1 silent: rank 0's step is described, copied and published; the wait is Python's (PUBLISHED)."""
    fake, mine = FakeArena(), np.arange(4, dtype=np.float64)
    assert fake.run(mine, 0, STAMP, 7) == arena_module.kernel_module.PUBLISHED
    assert fake.counters.tolist() == [1, 0]
    assert fake.desc[:4].tolist() == [0xBEEF, 0xFEED, 7, 0]
    assert np.array_equal(fake.slot(0, 0, np.float64, 4), mine) and np.array_equal(mine, np.arange(4.0))


@needs_kernel
def test_kernel_reduces_when_every_rank_described_the_same_call() -> None:
    fake = FakeArena()
    fake.peer_publishes(0, STAMP, 7, np.full(4, 10, dtype=np.int32))
    mine = np.arange(4, dtype=np.int32)
    assert fake.run(mine, 0, STAMP, 7) == arena_module.kernel_module.DONE
    assert mine.tolist() == [10, 11, 12, 13]
    theirs = np.arange(4, dtype=np.int32)  # a reduce's non-root: published, agreed, buffer untouched
    fake.peer_publishes(1, STAMP, 8, theirs)
    assert fake.run(theirs, 1, STAMP, 8, want=False) == arena_module.kernel_module.DONE
    assert theirs.tolist() == [0, 1, 2, 3]


def _split(fake: FakeArena, buf: np.ndarray, stamp: int = STAMP, want: bool = True) -> int:
    code = arena_module.KERNEL_DTYPES[buf.dtype]
    return fake.kernel.run_split(buf, code, 0, 0, stamp, 7, 0, False, want)


@needs_kernel
def test_three_steps_hand_over_at_each_point_the_peer_is_late() -> None:
    """run_split as rank 0 of 2: with the peer silent, its first step is published (PUBLISHED); with the
    peer's first step there, it reduces its half into its buffer, copies it over its half of its slot and
    publishes the second step (REDUCED; a rank that does not want the result publishes the third too and
    leaves its buffer as it was: DONE); with the peer's half there too, the result is whole (DONE)."""
    kernel = arena_module.kernel_module
    mine, theirs = np.arange(10, dtype=np.float64), np.arange(10, dtype=np.float64) * 100
    fake = FakeArena()
    assert _split(fake, mine.copy()) == kernel.PUBLISHED and fake.counters.tolist() == [1, 0]
    fake, out = FakeArena(), mine.copy()
    fake.peer_publishes(0, STAMP, 7, theirs)
    assert _split(fake, out) == kernel.REDUCED and fake.counters.tolist() == [2, 1]
    assert np.array_equal(out[:5], (mine + theirs)[:5]) and np.array_equal(out[5:], mine[5:])
    assert np.array_equal(fake.slot(0, 0, np.float64, 10), np.concatenate([(mine + theirs)[:5], mine[5:]]))
    fake, out = FakeArena(), mine.copy()
    fake.peer_publishes(0, STAMP, 7, theirs)
    assert _split(fake, out, want=False) == kernel.DONE and fake.counters.tolist() == [3, 1]
    assert np.array_equal(out, mine) and np.array_equal(fake.slot(0, 0, np.float64, 5), (mine + theirs)[:5])
    fake, out = FakeArena(), mine.copy()
    fake.peer_publishes(0, STAMP, 7, theirs)
    fake.slot(1, 0, np.float64, 10)[5:] = (mine + theirs)[5:]  # the peer's half, over its half of its slot
    fake.counters[1] = 2
    assert _split(fake, out) == kernel.DONE and np.array_equal(out, mine + theirs)
    assert fake.counters.tolist() == [3, 2]


@needs_kernel
def test_three_steps_leave_a_disagreement_to_python() -> None:
    fake = FakeArena()
    fake.peer_publishes(0, STAMP ^ 1, 7, np.ones(10))
    out = np.zeros(10)
    assert _split(fake, out) == arena_module.kernel_module.PUBLISHED
    assert fake.counters.tolist() == [1, 1] and not out.any()  # nothing reduced, nothing more published


@pytest.mark.parametrize("stamp,sequence", [(STAMP ^ (1 << 70), 7), (STAMP ^ 1, 7), (STAMP, 6)],
                         ids=["stamp high", "stamp low", "sequence"])
@needs_kernel
def test_kernel_leaves_a_disagreement_to_python(stamp: int, sequence: int) -> None:
    """A peer whose descriptor differs in any word: no reduction, PUBLISHED (Python's agree raises)."""
    fake = FakeArena()
    fake.peer_publishes(0, stamp, sequence, np.full(4, 10.0))
    mine = np.ones(4)
    assert fake.run(mine, 0, STAMP, 7) == arena_module.kernel_module.PUBLISHED
    assert mine.tolist() == [1.0] * 4


@needs_kernel
def test_kernel_does_not_start_a_step_whose_slots_are_in_use() -> None:
    """Step 1 before rank 1 published step 0: nothing is written (NOT_STARTED), Python waits and runs it."""
    fake = FakeArena()
    fake.counters[0] = 1
    mine = np.full(4, 3.0)
    assert fake.run(mine, 1, STAMP, 7) == arena_module.kernel_module.NOT_STARTED
    assert fake.counters.tolist() == [1, 0] and not fake.slot(0, 1, np.float64, 4).any()
    assert not fake.desc[8:16].any()


@needs_kernel
def test_kernel_rings_a_sleeping_peer_and_only_then() -> None:
    """The publish bumps a peer's doorbell sequence when the peer says it sleeps, not otherwise."""
    fake = FakeArena()
    fake.run(np.ones(2), 0, STAMP, 1)
    assert fake.bell[0] == 0
    fake.bell[1] = 1  # the peer sleeps
    fake.peer_publishes(0, STAMP, 1, np.ones(2))
    fake.counters[0] = 1
    fake.run(np.ones(2), 1, STAMP, 2)
    assert fake.bell[0] == 1


@needs_kernel
def test_kernel_refuses_a_buffer_larger_than_a_slot() -> None:
    fake = FakeArena()
    with pytest.raises(ValueError, match="slot"):
        fake.run(np.ones(FakeArena.SLOT // 8 + 1), 0, STAMP, 1)
    assert fake.counters.tolist() == [0, 0]


def ops_disagree(comm: tcoll.Communicator) -> tuple[str, bool]:
    """Rank 0 asks for max where the others ask for sum (both ops the kernel takes); then a right call."""
    _counting(comm)
    x = np.ones(4, dtype=np.float32)
    said = mismatch_said(lambda: comm.all_reduce(x, "max" if comm.rank == 0 else "sum", algorithm="shm"))
    y = np.full(4, comm.rank + 1.0, dtype=np.float32)
    comm.all_reduce(y, algorithm="shm")
    return said, bool(np.array_equal(y, np.full(4, comm.size * (comm.size + 1) / 2, dtype=np.float32)))


@needs_kernel
@pytest.mark.timeout(60)
def test_ranks_that_disagree_on_the_op_all_raise() -> None:
    """A disagreement the kernel sees in the descriptors is Python's MismatchError on every rank."""
    results = tcoll.spawn(ops_disagree, 3, timeout=50, transport="shm")
    assert_every_rank_raised(results, "op")


class WideFakeArena(FakeArena):
    SLOT = 64 << 10  # medium vectors, copied in with the kernel's vector loop


@needs_kernel
def test_medium_vectors_copy_in_whole() -> None:
    """48 steps of vectors around 56 KB, no two the same length: every step's slot and result are right."""
    fake = WideFakeArena()
    rng = np.random.default_rng(3)
    for step in range(48):
        count = 7000 + step
        mine, theirs = rng.standard_normal(count), rng.standard_normal(count)
        fake.peer_publishes(step, STAMP, step, theirs)
        out = mine.copy()
        assert fake.run(out, step, STAMP, step) == arena_module.kernel_module.DONE
        assert np.array_equal(fake.slot(0, step, np.float64, count), mine), step
        assert np.array_equal(out, mine + theirs), step


def _copy_case(page: np.ndarray, nbytes: int, src_at: int, dst_at: int, backwards: bool | None) -> None:
    """Copy nbytes from page[src_at:] to page[dst_at:] (they must not overlap) and check every byte, and that
    nothing around the destination changed."""
    page[dst_at - 64:dst_at + nbytes + 64] = 0xAB
    src = page[src_at:src_at + nbytes]
    src[:] = np.random.default_rng(nbytes + src_at).integers(0, 255, nbytes, dtype=np.uint8)
    args = () if backwards is None else (backwards,)
    arena_module.kernel_module.copy(page[dst_at:dst_at + nbytes], src, *args)
    assert np.array_equal(page[dst_at:dst_at + nbytes], src), (nbytes, src_at, dst_at, backwards)
    assert (page[dst_at - 64:dst_at] == 0xAB).all() and (page[dst_at + nbytes:dst_at + nbytes + 64] == 0xAB).all()


@needs_kernel
@pytest.mark.parametrize("backwards", [None, False, True])
def test_the_kernel_copy_is_exact_at_every_length_and_distance(backwards: bool | None) -> None:
    """The kernel's own copy (_native/copy.h): every length to 1 KiB and around the loop's multiples, the
    source at every offset of a cache line, the destination at distances to it (mod 4096) inside and outside
    the window where it copies backwards; forced each way and as calibrated. Nothing outside is touched."""
    page = np.zeros(5 * 4096 + (1 << 16), dtype=np.uint8)
    lengths = [*range(0, 1025), *(k * 128 + d for k in range(8, 40) for d in (-1, 0, 1)), 65536 + 77]
    for nbytes in lengths[::7] + [255, 256, 257, 511, 512, 513]:
        for src_off in (0, 1, 16, 31, 33, 63):
            for distance in (16, 64, 255, 256, 2048, 4080, 4095):
                src_at = 4096 + src_off
                dst_at = src_at + (nbytes // 4096 + 1) * 4096 + distance
                if dst_at + nbytes + 64 <= page.nbytes:
                    _copy_case(page, nbytes, src_at, dst_at, backwards)


@needs_kernel
@pytest.mark.parametrize("nbytes", [0, 1, 65535, 65536, 65537, 3 * 65536 + 7, 1 << 20, (16 << 20) + 33])
def test_the_kernel_copies_any_length(nbytes: int) -> None:
    """Lengths around the GIL's release and the non-temporal stores (16 MiB), unaligned; errors named."""
    src = np.random.default_rng(nbytes).integers(0, 256, nbytes + 3, dtype=np.uint8)[3:]  # not aligned
    dst = np.zeros(nbytes + 2, dtype=np.uint8)
    arena_module.kernel_module.copy(dst[1:-1], src)
    assert np.array_equal(dst[1:-1], src) and dst[0] == 0 and dst[-1] == 0
    with pytest.raises(ValueError, match="one length"):
        arena_module.kernel_module.copy(dst, src)
    with pytest.raises(BufferError):
        arena_module.kernel_module.copy(bytes(nbytes), src)  # not writable


@needs_kernel
def test_the_copy_direction_was_calibrated() -> None:
    """The module timed both directions when it loaded: two real copies of 256 KiB (not zero, not absurd)."""
    forward, backward = arena_module.kernel_module.COPY_CALIBRATION
    for ns in (forward, backward):
        assert 100 < ns < 50e6, (forward, backward)  # 256 KiB: between 2.6 TB/s and 5 MB/s
    assert arena_module.kernel_module.COPY_BACKWARDS in (0, 1)


def test_the_kernels_are_built_where_a_compiler_is() -> None:
    """An install on a machine with a C compiler has both kernels (their build is optional, so a failure is
    silent): the arena's and the rings' (tcoll.transport.shm._ring_kernel)."""
    import shutil
    import sysconfig

    from tcoll.transport.shm import rings as shm

    if not (shutil.which("cc") or shutil.which("gcc")) or not sysconfig.get_paths().get("include"):
        pytest.skip("no C compiler or no Python headers here")
    assert arena_module.kernel_module is not None
    assert shm.ring_kernel is not None


@needs_kernel
def test_the_kernel_keeps_its_mappings_while_it_lives() -> None:
    """A kernel holds exports of the arena and of the doorbells it rings, so that a call under way in one
    thread survives another thread closing the communicator: the mapping cannot go while the kernel lives."""
    import mmap

    from tcoll.p2p.waiting import Doorbell

    fake = FakeArena()
    with pytest.raises(BufferError):
        fake.map.close()
    bell_map = mmap.mmap(-1, mmap.PAGESIZE)
    bell = Doorbell(bell_map, 0)
    kernel = arena_module.kernel_module.Kernel(fake.map, fake.desc_at, fake.data_at, 2, 0, FakeArena.SLOT,
                                               [bell.memory])
    bell.release()  # the transport closing its channel: tolerated, the kernel still holds the bell
    with pytest.raises(BufferError):
        bell_map.close()
    bell_words = np.frombuffer(bell_map, np.uint32, 2)
    bell_words[1] = 1  # the peer sleeps
    fake.peer_publishes(0, STAMP, 1, np.ones(2))
    assert kernel.run(np.ones(2), 0, 0, 0, STAMP, 1, 0, False, True) == arena_module.kernel_module.DONE
    assert bell_words[0] == 1  # rung through the held view
    del kernel, fake.kernel, bell, bell_words  # the doorbell's view goes with the last holder
    fake.counters = fake.desc = fake.bell = None
    bell_map.close()
    fake.map.close()  # nothing holds them now


def disagreement(comm: tcoll.Communicator, case: str, count: int = 15000) -> tuple[str, bool]:
    """One call on which rank 0 differs from the others (through the one step, or across its limit), then a
    right call: (what the differing call raised, or "no error"; whether the next call was right). 15,000
    float32 (60 KB) in a 64 KiB slot: one step on 3 ranks, three on 2."""
    _counting(comm)
    first = comm.rank == 0
    if case == "size across the one-step limit":  # 64 KiB slot: one rank's call fits it, the other's does not
        x, op, root = np.ones(16384 if first else 16386, np.float32), "sum", None
    elif case == "size across the split":  # on 2 ranks, one step up to 16 KiB, three steps above
        x, op, root = np.ones(4096 if first else 4098, np.float32), "sum", None
    elif case == "dtype":
        x, op, root = np.ones(count, np.int32 if first else np.float32), "sum", None
    elif case == "root":
        x, op, root = np.ones(count, np.float32), "sum", 0 if first else 1
    else:
        x, op, root = np.ones(count, np.float32), "min" if first else "max", None
    said = mismatch_said(lambda: comm.all_reduce(x, op, algorithm="shm") if root is None
                         else comm.reduce(x, root, op, algorithm="shm"))
    y = np.full(5, comm.rank + 1.0)
    comm.all_reduce(y, algorithm="shm")
    return said, bool(np.array_equal(y, np.full(5, comm.size * (comm.size + 1) / 2)))


@needs_kernel
@pytest.mark.timeout(60)
@pytest.mark.parametrize("case,size", [("size across the one-step limit", 2), ("size across the split", 2),
                                       ("dtype", 3), ("root", 3), ("op", 3), ("dtype", 2), ("root", 2), ("op", 2)])
def test_ranks_that_disagree_in_the_one_step_all_raise(case: str, size: int) -> None:
    """Ranks that disagree in a call the one step serves (3 ranks) or the three steps (2 ranks), or on which
    side of a limit a call falls, get a MismatchError naming the difference on every rank, and the next
    call is right."""
    results = tcoll.spawn(disagreement, size, (case,), timeout=50, transport="shm", shm_slot=SLOT)
    assert_every_rank_raised(results, case)


@needs_kernel
@pytest.mark.timeout(60)
@pytest.mark.parametrize("case", ["dtype", "root", "op"])
def test_ranks_that_disagree_in_the_three_steps_on_more_ranks_all_raise(case: str) -> None:
    """The same on 3 ranks, in a call above the one step's 128 KiB that fits a wider slot (three steps)."""
    results = tcoll.spawn(disagreement, 3, (case, WIDE_SPLIT // 4), timeout=50, transport="shm",
                          shm_slot=WIDE_SLOT)
    assert_every_rank_raised(results, case)


@needs_kernel
@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.int64, ml_dtypes.bfloat16])
@pytest.mark.parametrize("parts", [2, 3, 5])
def test_reduce_into_reads_its_own_input_in_place_and_writes_two_outputs(dtype, parts: int) -> None:
    """reduce_into (the pipelined steps' one pass): the inputs in rank order, an output that is one of the
    inputs (a rank's own part, at every position), chunked past the accumulator's size; NumPy's result."""
    rng = np.random.default_rng(parts)
    count = 3 * (8 << 10) // np.dtype(dtype).itemsize + 5  # several chunks and a partial one
    for own in range(parts):
        inputs = [(rng.standard_normal(count) * 100).astype(dtype) for _ in range(parts)]
        expected = inputs[0].astype(dtype)
        for x in inputs[1:]:
            expected = (expected + x).astype(dtype)
        slot = np.zeros(count, dtype)
        kernel = arena_module.kernel_module
        code = arena_module.KERNEL_DTYPES[np.dtype(dtype)]
        assert kernel.reduce_into(code, 0, tuple(inputs), (slot, inputs[own]))
        assert np.array_equal(slot.view(np.uint8), expected.view(np.uint8)), own
        assert np.array_equal(inputs[own].view(np.uint8), expected.view(np.uint8)), own


@needs_kernel
def test_reduce_into_refuses_what_it_cannot_do() -> None:
    kernel = arena_module.kernel_module
    a, b = np.ones(8, np.float32), np.ones(8, np.float32)
    assert kernel.reduce_into(0, 4, (a, b), (np.zeros(8, np.float32),)) is False  # band on floats: Python's
    with pytest.raises(ValueError, match="one length"):
        kernel.reduce_into(0, 0, (a, np.ones(4, np.float32)), (np.zeros(8, np.float32),))
    with pytest.raises(ValueError, match="out of range"):
        kernel.reduce_into(0, 0, (a, b), ())
