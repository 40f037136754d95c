"""The v-collectives through the shared-memory arena: all_gatherv, gatherv, scatterv and all_to_allv,
blocking on one host, against NumPy, with counts that differ (zero included) and blocks wider than a slot."""

from __future__ import annotations

import numpy as np
import pytest

import tcoll


def rows(src: int, dst: int, salt: int) -> int:
    return (src * 3 + dst * 5 + salt) % 7  # 0..6 rows, zeros included


def block(src: int, dst: int, salt: int, width: int) -> np.ndarray:
    n = rows(src, dst, salt)
    return (np.arange(n * width, dtype=np.int64).reshape(n, width) + src * 1_000_000 + dst * 1000 + salt)


def v_battery(comm: tcoll.Communicator, width: int) -> bool:
    r, p = comm.rank, comm.size
    comm.barrier()  # opens the arena (its opening talks point-to-point)
    engine, sends = comm.core.engine, []
    engine.isend = lambda *args, real=engine.isend, **kw: sends.append(1) or real(*args, **kw)  # type: ignore
    for algorithm in ("shm", "auto"):
        for salt in range(3):
            got = comm.all_to_allv([block(r, d, salt, width) for d in range(p)], algorithm=algorithm)
            assert all(np.array_equal(got[q], block(q, r, salt, width)) for q in range(p)), (algorithm, salt)
            same = comm.all_to_allv([block(r, d, 0, width)[:2] * 0 + r for d in range(p)], algorithm=algorithm)
            assert all(g.shape[0] == min(2, rows(q, r, 0)) and (g == q).all() for q, g in enumerate(same))
            mine = block(r, r, salt, width)
            everyone = comm.all_gatherv(mine, algorithm=algorithm)
            assert all(np.array_equal(everyone[q], block(q, q, salt, width)) for q in range(p))
            root = salt % p
            gathered = comm.gatherv(mine, root=root, algorithm=algorithm)
            if r == root:
                assert all(np.array_equal(gathered[q], block(q, q, salt, width)) for q in range(p))
            chunks = [block(root, d, salt, width) for d in range(p)] if r == root else None
            assert np.array_equal(comm.scatterv(chunks, root=root, algorithm=algorithm), block(root, r, salt, width))
    assert not sends, "a blocking v-collective on one host sent point-to-point messages"
    return True


@pytest.mark.timeout(120)
@pytest.mark.parametrize("size,width,slot", [(4, 3, 1 << 20), (3, 700, 4096), (5, 1, 1 << 20)])
def test_vcollectives_on_the_arena(size: int, width: int, slot: int) -> None:
    """slot 4096: a block of 6 x 700 int64 takes several steps of the arena."""
    assert tcoll.spawn(v_battery, size, (width,), timeout=120, transport="shm", shm_slot=slot) == [True] * size


def test_all_to_allv_on_one_host_is_one_call_on_the_arena() -> None:
    from tcoll.algos.registry import lookup

    assert tcoll.algorithms("all_to_allv") == ["shm"] and lookup("all_to_allv", "shm").direct


def mismatch_then_right(comm: tcoll.Communicator) -> list[str]:
    """One rank's chunks have another dtype: a MismatchError on every rank, and the next call is right."""
    r, p = comm.rank, comm.size
    dtype = np.float32 if r == 1 else np.int64
    seen = []
    try:
        comm.all_to_allv([np.zeros((2, 3), dtype=dtype) for _ in range(p)])
        seen.append("ok")
    except tcoll.MismatchError as exc:
        seen.append(f"MismatchError: {exc}")
    got = comm.all_to_allv([np.full((d + 1, 2), float(r)) for d in range(p)])
    seen.append(str(all(g.shape == (r + 1, 2) and bool((g == q).all()) for q, g in enumerate(got))))
    return seen


@pytest.mark.timeout(120)
def test_a_dtype_mismatch_is_an_error_on_every_rank() -> None:
    for rank, seen in enumerate(tcoll.spawn(mismatch_then_right, 3, timeout=120, transport="shm")):
        assert seen[0].startswith("MismatchError") and "dtype" in seen[0] and seen[1] == "True", (rank, seen)


def small_slot(comm: tcoll.Communicator) -> list[str]:
    """A slot too small for the all_to_allv headers: auto moves the data another way; "shm" says what to raise."""
    r, p = comm.rank, comm.size
    seen = []
    for salt in range(2):
        got = comm.all_to_allv([block(r, d, salt, 3) for d in range(p)])
        seen.append(str(all(np.array_equal(got[q], block(q, r, salt, 3)) for q in range(p))))
    try:
        comm.all_to_allv([block(r, d, 0, 3) for d in range(p)], algorithm="shm")
        seen.append("shm accepted a slot that cannot hold the headers")
    except ValueError as exc:
        seen.append("TCOLL_SHM_SLOT" in str(exc) and str(exc))
    seen.append(str(np.array_equal(comm.all_reduce(np.full(3, r)), np.full(3, p * (p - 1) // 2))))
    return seen


@pytest.mark.timeout(120)
@pytest.mark.parametrize("size,slot", [(3, 256), (2, 64)])
def test_all_to_allv_with_a_slot_smaller_than_its_headers(size: int, slot: int) -> None:
    """The headers take 256 + 8 x size bytes of the first step's slot (and each rank a share of the rest)."""
    for rank, seen in enumerate(tcoll.spawn(small_slot, size, timeout=100, transport="shm", shm_slot=str(slot))):
        assert seen[:2] == ["True", "True"] and "TCOLL_SHM_SLOT" in seen[2] and seen[3] == "True", (rank, seen)
