"""scatter on one host in one call: root's description rides in the first step's slot (tcoll.shm.described).

NumPy's chunks on every rank, for 1 to 8 ranks, chunks from a byte to many
slots (a small slot: many steps), with and without `out`, a list of chunks,
torch tensors, a root buffer in shared memory (lent), and repeated calls run
whole in C (the express call); an `out` that does not match root's chunks,
and ranks that disagree on the root, are errors on every rank.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import tcoll
from tcoll.comm import describe
from tcoll.shm.described import DESCRIPTION_BYTES
from tcoll.shm.kernel_abi import kernel_module

pytestmark = pytest.mark.usefixtures("no_leftovers")
needs_kernel = pytest.mark.skipif(kernel_module is None, reason="the arena's C kernel is not built")
SLOT = "1024"  # bytes: 1 KiB chunks take several steps


def _chunks(p: int, count: int, salt: int, dtype: str = "float64") -> np.ndarray:
    return (np.arange(p * count).reshape(p, count) * 3 + salt).astype(dtype)


def many_calls(comm: tcoll.Communicator, counts: list[int], root: int, how: str) -> list[str]:
    """Scatters of every size in `counts` (each twice, refilled), checked against the chunks NumPy cut."""
    p, me = comm.size, comm.rank
    bad = []
    for count in counts:
        chunks = _chunks(p, count, 0)
        out = np.empty(count) if how == "out" else None
        for salt in range(2):
            chunks[...] = _chunks(p, count, salt)
            given = list(chunks) if how == "list" else chunks
            got = comm.scatter(given if me == root else None, root, out=out)
            if not np.array_equal(got, _chunks(p, count, salt)[me]) or (out is not None and got is not out):
                bad.append(f"rank {me}: {count} items, call {salt}: {got!r}")
    return bad


@pytest.mark.timeout(120)
@pytest.mark.parametrize("size", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("how", ["out", "none", "list"])
def test_every_rank_gets_its_chunk(size: int, how: str) -> None:
    counts = [0, 1, 7, 130, 1000]  # (float64: 1000 items are 8 KB, eight 1 KiB slots and more)
    root = size // 2
    results = tcoll.spawn(many_calls, size, (counts, root, how), timeout=100, transport="shm", shm_slot=SLOT)
    assert not [line for bad in results for line in bad], results


@pytest.mark.timeout(120)
@pytest.mark.parametrize("size", [2, 3, 4])
@pytest.mark.parametrize("how", ["out", "none"])
def test_chunks_the_kernel_streams(size: int, how: str) -> None:
    """The default slot: chunks from 32 KiB stream through root's slot in the kernel (root announces each 16 KiB),
    up to what the first step holds; larger ones take many steps."""
    counts = [4096, 5000, 40_000, 70_000]  # float64: 32 KiB, 40 KB, 320 KB (one step up to 3 ranks), 560 KB
    results = tcoll.spawn(many_calls, size, (counts, size - 1, how), timeout=100, transport="shm")
    assert not [line for bad in results for line in bad], results


def test_the_description_is_the_width_the_arena_reads() -> None:
    assert DESCRIPTION_BYTES == describe.META_BYTES
    if kernel_module is not None:
        assert kernel_module.DESCRIPTION_BYTES == DESCRIPTION_BYTES


def express_calls(comm: tcoll.Communicator, count: int) -> tuple[list[str], int]:
    """Repeated scatters into one `out` from one chunks array: NumPy's chunks every time, and the calls the
    express call ran whole (20_000 int32: 80 KB chunks, streamed in the kernel)."""
    p, me = comm.size, comm.rank
    chunks, out = _chunks(p, count, 0, "int32"), np.empty(count, np.int32)
    bad = []
    for call in range(30):
        chunks[...] = _chunks(p, count, call, "int32")
        got = comm.scatter(chunks if me == 1 else None, 1, out=out)
        if got is not out or not np.array_equal(out, _chunks(p, count, call, "int32")[me]):
            bad.append(f"rank {me} call {call}")
    entry = comm.core.dispatch.lean.get((id(chunks if me == 1 else None), id(out), "scatter", 1, "auto"))
    return bad, getattr(getattr(entry, "express", None), "completed", 0)


@needs_kernel
@pytest.mark.alone  # (on 2 ranks every rank must come within the kernel's spin)
@pytest.mark.timeout(60)
@pytest.mark.parametrize("size,count", [(2, 1), (2, 1000), (2, 20_000), (3, 50), (4, 1000)])
def test_repeated_calls_run_whole_in_c(size: int, count: int) -> None:
    results = tcoll.spawn(express_calls, size, (count,), timeout=50, transport="shm")
    assert not [line for bad, _ in results for line in bad], results
    # A rank later than the kernel's spin hands the call over to Python: with more ranks than cores, one rank
    # may do so every time; on 2 ranks every rank runs calls whole.
    done = [completed for _, completed in results]
    assert (all if size == 2 else any)(completed > 0 for completed in done), results


def wrong_out(comm: tcoll.Communicator, when: str) -> tuple[str, bool]:
    """Rank 2's out does not fit root's chunks (at once, or after calls that ran express, when root's chunks
    change shape; the others pass no out): what each rank raised, and whether the next call was right."""
    p, me = comm.size, comm.rank
    chunks, out = _chunks(p, 6, 0), np.empty(6)
    other = _chunks(p, 3, 0)
    calls = 8 if when == "after express" else 0
    for _ in range(calls):
        comm.scatter(chunks if me == 0 else None, out=out)
    bad_out = np.empty(5) if when == "at once" else out  # (after express: root sends `other`, of 3 items)
    try:
        comm.scatter((other if calls else chunks) if me == 0 else None, out=bad_out if me == 2 else None)
        said = "no error"
    except tcoll.TcollError as exc:
        said = f"{type(exc).__name__}: {exc}"
    after = comm.scatter(chunks if me == 0 else None)
    return said, bool(np.array_equal(after, chunks[me]))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("when", ["at once", "after express"])
def test_an_out_that_does_not_fit_is_an_error_on_every_rank(when: str) -> None:
    results = tcoll.spawn(wrong_out, 3, (when,), timeout=50, transport="shm")
    for rank, (said, after_ok) in enumerate(results):
        assert after_ok, (rank, results)
        assert said.startswith("MismatchError") and "out has shape" in said, (rank, results)
        assert rank == 2 or "rank 2" in said, (rank, results)


def two_roots(comm: tcoll.Communicator, how: str) -> tuple[str, bool]:
    """Ranks that disagree on the root: each of ranks 0 and 1 believes the other is root (both wait for root's
    step unless they agree first), or each believes it is root itself (both write)."""
    p, me = comm.size, comm.rank
    chunks = _chunks(p, 4, 0)
    root = (1 if me == 0 else 0) if how == "each the other" else (1 if me == 1 else 0)
    try:
        comm.scatter(chunks if me == root else None, root)
        said = "no error"
    except tcoll.MismatchError as exc:
        said = str(exc)
    after = comm.scatter(chunks if me == 0 else None, 0)
    return said, bool(np.array_equal(after, chunks[me]))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("how", ["each the other", "each itself"])
def test_ranks_that_disagree_on_the_root_all_raise(how: str) -> None:
    for rank, (said, after_ok) in enumerate(tcoll.spawn(two_roots, 3, (how,), timeout=50, transport="shm")):
        assert "root" in said and after_ok, (rank, said)


def plans(comm: tcoll.Communicator) -> list[str]:
    """scatter_init with `out` on every rank (and chunks on every rank, which only root's plan reads): NumPy's
    chunks at every run, the chunks of the other ranks untouched."""
    p, me = comm.size, comm.rank
    chunks, out = _chunks(p, 8, 0), np.empty(8)
    plan = comm.scatter_init(chunks, 1, out=out)
    bad = []
    for run in range(6):
        chunks[...] = _chunks(p, 8, run) if me == 1 else -1.0
        got = plan()
        if not np.array_equal(out, _chunks(p, 8, run)[me]) or (me != 1 and not (chunks == -1.0).all()):
            bad.append(f"rank {me} run {run}: {got!r}, chunks {chunks!r}")
    return bad


@pytest.mark.timeout(60)
@pytest.mark.parametrize("size", [2, 3])
def test_plans_with_out_on_every_rank(size: int) -> None:
    results = tcoll.spawn(plans, size, timeout=50, transport="shm")
    assert not [line for bad in results for line in bad], results


def mismatch_in_many_steps(comm: tcoll.Communicator) -> tuple[str, bool]:
    """A 1 KiB slot: chunks of 4 KB take many steps; rank 2's out is one item short."""
    p, me = comm.size, comm.rank
    chunks = _chunks(p, 500, 1)
    try:
        comm.scatter(chunks if me == 0 else None, out=np.empty(499) if me == 2 else None)
        said = "no error"
    except tcoll.TcollError as exc:
        said = f"{type(exc).__name__}: {exc}"
    return said, bool(np.array_equal(comm.scatter(chunks if me == 0 else None), chunks[me]))


@pytest.mark.timeout(60)
def test_an_out_that_does_not_fit_a_call_of_many_steps() -> None:
    results = tcoll.spawn(mismatch_in_many_steps, 3, timeout=50, transport="shm", shm_slot=SLOT)
    for rank, (said, after_ok) in enumerate(results):
        assert after_ok and said.startswith("MismatchError") and "out has shape" in said, (rank, results)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("counts", [[3, 20_000], [1000]])
def test_thread_ranks(counts: list[int]) -> None:
    """Ranks that are threads of one process (the kernel lets the others run while it copies and waits)."""
    results = tcoll.spawn(many_calls, 3, (counts, 1, "out"), threads=True, timeout=50)
    assert not [line for bad in results for line in bad], results


def lent_root(comm: tcoll.Communicator, count: int) -> list[str]:
    """Root's chunks in shared memory (comm.empty): large calls read them in place; small ones copy."""
    p, me = comm.size, comm.rank
    chunks = comm.empty((p, count), np.float32)
    bad = []
    for salt in range(3):
        chunks[...] = _chunks(p, count, salt, "float32")
        got = comm.scatter(chunks if me == 0 else None)
        if not np.array_equal(got, _chunks(p, count, salt, "float32")[me]):
            bad.append(f"rank {me} call {salt}")
    return bad


@pytest.mark.timeout(60)
@pytest.mark.parametrize("count", [3, 40_000])
def test_a_root_buffer_in_shared_memory(count: int) -> None:
    results = tcoll.spawn(lent_root, 3, (count,), timeout=50, transport="shm")
    assert not [line for bad in results for line in bad], results


def torch_chunks(comm: tcoll.Communicator) -> list[str]:
    import torch

    p, me = comm.size, comm.rank
    chunks = torch.arange(p * 3, dtype=torch.bfloat16).reshape(p, 3)
    got = comm.scatter(chunks if me == 0 else None)
    into = torch.zeros(3, dtype=torch.bfloat16)
    again = comm.scatter(chunks if me == 0 else None, out=into)
    ok = isinstance(got, torch.Tensor) and torch.equal(got, chunks[me]) and again is into and torch.equal(into, got)
    return [] if ok else [f"rank {me}: {got!r} {again!r}"]


@pytest.mark.timeout(60)
def test_torch_tensors() -> None:
    pytest.importorskip("torch")
    results = tcoll.spawn(torch_chunks, 3, timeout=50, transport="shm")
    assert not [line for bad in results for line in bad], results


def over_tcp(comm: tcoll.Communicator) -> list[Any]:
    chunks = _chunks(comm.size, 5, 2)
    return [comm.scatter(chunks if comm.rank == 1 else None, 1).tolist(), chunks[comm.rank].tolist()]


@pytest.mark.timeout(60)
def test_over_tcp_the_description_comes_first() -> None:
    for got, want in tcoll.spawn(over_tcp, 3, timeout=50, transport="tcp"):
        assert got == want


def forced(comm: tcoll.Communicator) -> tuple[bool, bool]:
    """TCOLL_ALGO=scatter=binomial: NumPy's chunks, and no call remembered for the arena's scatter."""
    p, me = comm.size, comm.rank
    chunks, out = _chunks(p, 6, 2), np.empty(6)
    for _ in range(3):
        comm.scatter(chunks if me == 0 else None, out=out)
    key = (id(chunks if me == 0 else None), id(out), "scatter", 0, "auto")
    return bool(np.array_equal(out, chunks[me])), key not in comm.core.dispatch.lean


@pytest.mark.timeout(60)
def test_a_forced_algorithm_is_still_the_one_that_runs() -> None:
    for rank, (right, off_arena) in enumerate(tcoll.spawn(forced, 3, timeout=50, transport="shm",
                                                          env={"TCOLL_ALGO": "scatter=binomial"})):
        assert right and off_arena, rank


def new_description(comm: tcoll.Communicator) -> tuple[list[str], bool, bool]:
    """Root switches from NumPy chunks to a torch tensor of the same shape and dtype: the description differs
    (its kind), the other ranks' out still fits it, and their express call is made anew for it. Returns the
    wrong results, whether an express call was made for the first chunks, and whether another for the second.
    (Not how many calls each ran whole: that takes every rank arriving within the kernel's spin, which a
    loaded machine does not promise.)"""
    import torch

    p, me = comm.size, comm.rank
    out = np.empty(5, np.float32)
    entry_key = (id(None), id(out), "scatter", 0, "auto")
    bad, made = [], []
    for kind in ("numpy", "torch"):
        chunks = _chunks(p, 5, 3, "float32")
        given = torch.from_numpy(chunks) if kind == "torch" else chunks
        for _ in range(12):
            got = comm.scatter(given if me == 0 else None, 0, out=out)
            if not np.array_equal(out, chunks[me]) or (me != 0 and got is not out):
                bad.append(f"rank {me} {kind}")
        made.append(getattr(comm.core.dispatch.lean.get(entry_key), "express", None))
    return bad, made[0] is not None, made[1] is not None and made[1] is not made[0]


@needs_kernel
@pytest.mark.timeout(60)
def test_the_others_express_call_follows_a_new_description() -> None:
    pytest.importorskip("torch")
    results = tcoll.spawn(new_description, 2, timeout=50, transport="shm")
    assert not [line for bad, _, _ in results for line in bad], results
    _, first_made, made_anew = results[1]  # (rank 1: root's chunks are another array, so another call)
    assert first_made and made_anew, results


def another_collective(comm: tcoll.Communicator) -> tuple[str, bool]:
    """Rank 2 broadcasts where ranks 0 and 1 scatter (root 0): every rank raises, and the next call is right."""
    p, me = comm.size, comm.rank
    chunks, out = _chunks(p, 4, 0), np.empty(4)
    for _ in range(4):  # (express calls first)
        comm.scatter(chunks if me == 0 else None, out=out)
    try:
        if me == 2:
            comm.broadcast(np.empty(4), 0)
        else:
            comm.scatter(chunks if me == 0 else None, out=out)
        said = "no error"
    except tcoll.MismatchError as exc:
        said = str(exc)
    return said, bool(np.array_equal(comm.scatter(chunks if me == 0 else None), chunks[me]))


@pytest.mark.timeout(60)
def test_another_collective_on_one_rank_is_an_error_on_every_rank() -> None:
    for rank, (said, after_ok) in enumerate(tcoll.spawn(another_collective, 3, timeout=50, transport="shm")):
        assert "scatter" in said and "broadcast" in said and after_ok, (rank, said)
