"""The recorder runs every shared-memory direct algorithm on a stand-in arena, and what each rank copies
into and out of the slots, and combines, is what docs/collectives.md and the cost model say."""

from __future__ import annotations

import sys

import numpy as np
import pytest

import tcoll.comm.dispatch  # noqa: F401 - registers every algorithm
from tcoll.algos.registry import REGISTRY
from tcoll.algos.topology import part_bounds
from tcoll.comm.describe import META_BYTES
from tcoll.shm import record as shm_record
from tcoll.shm.address import agreed_piece, agreed_slot
from tcoll.shm.arena import ZERO_COPY_BYTES
from tcoll.shm.record import record_direct
from tcoll.shm.vector import one_step_limit

DIRECT = [(collective, name) for collective, infos in REGISTRY.items() for name, info in infos.items() if info.direct]
# (elements per rank or block, TCOLL_SHM_SLOT): one step; many small slots; large enough to lend (one more step)
CASES = [(4, 1 << 20), (1000, 512), (300, 256), (5000, 4096), (4000, 1 << 20), (40000, 1 << 20)]
LARGE = [(size, 4, 1 << 20) for size in (16, 37, 64)] + [(37, 300, 256)]  # larger worlds, fewer cases
ITEM = 4  # float32


def _pieces(nbytes: int, piece: int) -> int:
    return max(1, -(-nbytes // piece))


def expected(collective: str, size: int, rank: int, count: int, slot: int, root: int = 0) -> tuple:
    """((bytes copied in, bytes copied out), bytes combined, arena steps) of `rank`, from the docs' table."""
    p, n = size, count * ITEM  # n: one rank's vector, or one block
    slot = agreed_slot(slot, p)
    piece, share = slot // ITEM * ITEM, slot // p
    lend = 1 if n * (p if collective in ("gather", "scatter", "reduce_scatter", "all_to_all") else 1) \
        >= ZERO_COPY_BYTES else 0
    if p == 1:
        return (0, 0), 0, 0
    if collective in ("all_reduce", "reduce"):
        gets = collective == "all_reduce" or rank == root
        if n <= slot and n <= one_step_limit(p):  # one step: each rank reduces all slots
            return (n, 0), (p - 1) * n if gets else 0, 1
        if n > slot:  # larger than a slot: in pieces of the arena's piece size
            piece = agreed_piece(slot) // ITEM * ITEM
        parts = [part_bounds(min(piece, n - lo) // ITEM, p, rank) for lo in range(0, n, piece)]
        mine = ITEM * sum(hi - lo for lo, hi in parts)  # this rank's 1/p of every piece
        # its own part is never copied in: it reads it from its buffer and reduces it into its own part of its
        # slot; the others' parts go in, and (if it gets the result) all parts come out, its own included
        copied = (n - mine, n if gets else 0)
        return copied, (p - 1) * mine, 3 if n <= slot else 2 * _pieces(n, piece)
    if collective == "broadcast":  # root writes each piece once, every other rank copies it out
        return ((n, 0) if rank == root else (0, n)), 0, _pieces(n, slot) + lend
    if collective == "all_gather":  # every rank writes its block, then copies all p blocks out
        return (n, p * n), 0, _pieces(n, slot)
    if collective == "gather":
        return ((0, (p - 1) * n) if rank == root else (n, 0)), 0, _pieces(n, slot) + lend
    if collective == "scatter":
        return (((p - 1) * n, 0) if rank == root else (0, n)), 0, _pieces(n, share) + lend
    if collective == "scatter_described":  # root's description heads its first step's slot; then a closing step
        first = (slot - META_BYTES) // p
        steps = 2 + (_pieces(n - first, share) if n > first else 0)
        return ((META_BYTES + (p - 1) * n, 0) if rank == root else (0, META_BYTES + n)), 0, steps
    if collective == "reduce_scatter":  # rank r reduces block r out of every slot into its output
        return (p * n, 0), (p - 1) * n, _pieces(n, share // ITEM * ITEM) + lend
    if collective == "all_to_all":
        return ((p - 1) * n, (p - 1) * n), 0, _pieces(n, share) + lend
    if collective == "barrier":
        return (0, 0), 0, 1
    if collective in ("scan", "exscan"):  # rank r combines the slots of ranks 0..r (exscan 0..r-1)
        operands = rank + 1 if collective == "scan" else rank
        return (n, 0), max(0, operands - 1) * n, _pieces(n, piece)
    assert collective == "all_to_allv"  # the header (counts) travels at the head of the first step's slots
    width = META_BYTES + 8 * p
    first = (slot - width) // p
    return (width + (p - 1) * n, p * width + (p - 1) * n), 0, 1 + _pieces(max(0, n - first), share) - (n <= first)


@pytest.mark.parametrize(("collective", "name"), DIRECT)
def test_recorded_copies_and_combines_are_the_documented_ones(collective: str, name: str) -> None:
    for size, count, slot in [(size, *case) for size in range(1, 9) for case in CASES] + LARGE:
        if collective in ("all_reduce", "reduce", "broadcast", "scan", "exscan"):
            count *= size  # a vector that is cut into p parts
        if collective == "all_to_allv" and agreed_slot(slot, size) < META_BYTES + 9 * size:
            continue  # the headers leave no room in the slot: the algorithm raises ValueError
        if collective == "scatter_described" and agreed_slot(slot, size) < META_BYTES + size:
            continue  # (as all_to_allv: the description leaves no room; the communicator scatters another way)
        root = size // 2
        schedule = record_direct(collective, name, size, count, slot_bytes=slot, root=root)
        for rank in range(size):
            got = schedule.copied(rank), schedule.combined(rank)
            want = expected(collective, size, rank, count, slot, root)
            assert got == want[:2], (size, count, slot, rank, got, want)
        assert schedule.steps == expected(collective, size, 0, count, slot, root)[2], (size, count, slot)


def _model(collective: str, name: str, nbytes: int, size: int, monkeypatch: pytest.MonkeyPatch,
           sync: float, copy: float, reduce: float) -> float:
    """The cost model's time with its arena constants replaced: (0, 1, 0) gives the bytes it copies."""
    info = REGISTRY[collective][name]
    module = sys.modules[info.run.__module__]
    for constant, value in (("ARENA_SYNC", sync), ("ARENA_COPY", copy), ("ARENA_REDUCE", reduce)):
        if constant != "ARENA_REDUCE" or hasattr(module, constant):  # (a module that only moves data reduces nothing)
            monkeypatch.setattr(module, constant, value)
    return info.cost(None, nbytes, size)  # type: ignore[arg-type]


def _critical_path(collective: str, schedule) -> tuple[int, int]:
    """(bytes copied, bytes combined) on the longest chain: a writer's copy in, then a reader's copy out."""
    p = schedule.size
    ins = [schedule.copied(r)[0] for r in range(p)]
    outs = [schedule.copied(r)[1] for r in range(p)]
    combined = max(schedule.combined(r) for r in range(p))
    if collective in ("broadcast", "gather", "scatter", "scatter_described"):
        return max(ins) + max(outs), combined
    return max(i + o for i, o in zip(ins, outs)), combined


@pytest.mark.parametrize(("collective", "name"), [(c, n) for c, n in DIRECT if c not in ("all_to_allv", "barrier")])
def test_recorded_bytes_are_the_cost_models(collective: str, name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The model's copy and reduction terms are the recorded bytes of the longest chain (its step term is
    its own: one sync per 1 MiB, a closing step for the block moves)."""
    for size in (2, 3, 4, 8):
        for count in (64, 8192):  # one small step; several 1 MiB slots' worth of blocks
            count *= size
            schedule = record_direct(collective, name, size, count)
            copied, combined = _critical_path(collective, schedule)
            nbytes = schedule.nbytes
            assert _model(collective, name, nbytes, size, monkeypatch, 0, 1, 0) == pytest.approx(copied), size
            assert _model(collective, name, nbytes, size, monkeypatch, 0, 0, 1) == pytest.approx(combined), size


def test_all_reduce_on_four_ranks_step_by_step() -> None:
    """16 floats in 64-byte slots (4 floats): per piece, each rank writes all but its own quarter, reduces
    its quarter (its own read in place) into its own slot of the next step, and copies every quarter out."""
    schedule = record_direct("all_reduce", "shm", 4, 16, slot_bytes=64)
    assert agreed_slot(64, 4) == 256 and schedule.steps == 1  # slots are at least 64 B per rank: one step
    schedule = record_direct("all_reduce", "shm", 4, 16 * 1024, slot_bytes=256)
    assert schedule.steps == 2 * 256
    step0 = [(a.rank, a.owner, a.nbytes, a.write, a.combine) for a in schedule.accesses if a.step == 0]
    writes = [(r, r, n, True, False) for r in range(4) for n in (64 * r, 256 - 64 * (r + 1)) if n]
    assert sorted(step0) == sorted(writes + [(r, q, 64, False, True) for r in range(4) for q in range(4) if q != r])
    step1 = sorted((a.rank, a.owner, a.nbytes, a.write, a.combine) for a in schedule.accesses if a.step == 1)
    assert step1 == sorted([(r, r, 64, True, True) for r in range(4)]
                           + [(r, q, 64, False, False) for r in range(4) for q in range(4)])


def test_a_read_without_its_wait_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(shm_record.RecordingArena, "wait_all", lambda self, step: None)
    monkeypatch.setattr(shm_record.RecordingArena, "agree", lambda self, step: None)
    with pytest.raises(RuntimeError, match="before rank 1 published it"):
        record_direct("all_gather", "shm", 2, 4)


def test_a_read_of_bytes_nobody_wrote_is_caught() -> None:
    schedule = record_direct("barrier", "shm", 2)
    arena = shm_record.RecordingArena(schedule, 0, 256)
    arena.slot(1, 0)[:8] = np.zeros(8, np.uint8)  # rank 0 writes 8 bytes of rank 1's slot and reads 16
    np.asarray(arena.slot(1, 0)[:16])
    with pytest.raises(RuntimeError, match="no rank wrote"):
        shm_record._check([arena])


def test_the_all_to_allv_header_is_the_communicators() -> None:
    assert shm_record.HEADER_BYTES == META_BYTES


def test_point_to_point_algorithms_are_refused() -> None:
    with pytest.raises(ValueError, match="sends messages"):
        record_direct("all_reduce", "ring", 4, 16)
