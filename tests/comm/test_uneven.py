"""Tests of the uneven-size collectives: all_gatherv, gatherv, scatterv, all_to_allv, reduce_scatterv.

Rank r's rows are value(r, ...) with a rank-dependent number of rows (zero
for some ranks); expected results are built from the same formula with
NumPy. Every uneven-capable registered algorithm of the data phase runs,
and "auto"; NumPy arrays and torch tensors; sync and async_op.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import tcoll
from helpers.cases import runnable
from tcoll import MismatchError
from tcoll.algos.registry import REGISTRY

TRAILING = (2, 3)


def uneven(collective: str) -> list[str]:
    """The algorithms an uneven call of `collective` can name (the shared-memory ones run only reduce_scatterv)."""
    return ["auto"] + [name for name, info in REGISTRY[collective].items() if info.uneven and not info.direct]


def rows_of(r: int) -> int:
    return (3 * r) % 4  # 0, 3, 2, 1, 0, ...: some ranks contribute nothing


def value(r: int, nrows: int, salt: int = 0, dtype: Any = np.float64) -> np.ndarray:
    n = nrows * 6
    return ((np.arange(n) * 7 + r * 1000 + salt * 13) % 4093).astype(dtype).reshape(nrows, *TRAILING)


def as_kind(arr: np.ndarray, use_torch: bool) -> Any:
    if use_torch:
        import torch

        return torch.from_numpy(arr.copy())
    return arr


def to_numpy(x: Any, use_torch: bool) -> np.ndarray:
    if use_torch:
        import torch

        assert isinstance(x, torch.Tensor), type(x)
        return x.numpy()
    assert isinstance(x, np.ndarray), type(x)
    return x


def assert_list(got: Any, expected: list[np.ndarray], use_torch: bool, what: str) -> None:
    assert isinstance(got, list) and len(got) == len(expected), what
    for i, (g, e) in enumerate(zip(got, expected)):
        arr = to_numpy(g, use_torch)
        assert arr.shape == e.shape and arr.dtype == e.dtype, (what, i, arr.shape, e.shape, arr.dtype)
        np.testing.assert_array_equal(arr, e, err_msg=f"{what} entry {i}")


# -- the checks, run on every rank ------------------------------------------------------------


def check_all_gatherv(comm: tcoll.Communicator, use_torch: bool) -> None:
    r, p = comm.rank, comm.size
    for salt, algorithm in enumerate(uneven("all_gather")):
        x = as_kind(value(r, rows_of(r), salt), use_torch)
        expected = [value(i, rows_of(i), salt) for i in range(p)]
        assert_list(comm.all_gatherv(x, algorithm=algorithm), expected, use_torch, f"all_gatherv {algorithm}")
        work = comm.all_gatherv(x, algorithm=algorithm, async_op=True)
        assert_list(work.wait(), expected, use_torch, f"all_gatherv {algorithm} async")
    # 1-D inputs, and everyone empty
    got = comm.all_gatherv(as_kind(np.arange(r, dtype=np.int32), use_torch))
    assert_list(got, [np.arange(i, dtype=np.int32) for i in range(p)], use_torch, "all_gatherv 1-D")
    got = comm.all_gatherv(as_kind(np.zeros((0, 5), np.int16), use_torch))
    assert_list(got, [np.zeros((0, 5), np.int16)] * p, use_torch, "all_gatherv empty")


def check_gatherv(comm: tcoll.Communicator, use_torch: bool) -> None:
    r, p = comm.rank, comm.size
    for salt, algorithm in enumerate(uneven("gather")):
        for root in {0, p - 1, p // 2}:
            x = as_kind(value(r, rows_of(r + root), salt), use_torch)
            expected = [value(i, rows_of(i + root), salt) for i in range(p)]
            got = comm.gatherv(x, root=root, algorithm=algorithm)
            if r == root:
                assert_list(got, expected, use_torch, f"gatherv {algorithm} root {root}")
            else:
                assert got is None
    got = comm.gatherv(as_kind(value(r, 1), use_torch), root=0, async_op=True).wait()
    if r == 0:
        assert_list(got, [value(i, 1) for i in range(p)], use_torch, "gatherv async")


def check_scatterv(comm: tcoll.Communicator, use_torch: bool) -> None:
    r, p = comm.rank, comm.size
    for salt, algorithm in enumerate(uneven("scatter")):
        for root in {0, p - 1}:
            chunks = [as_kind(value(j, rows_of(j + 1), salt), use_torch) for j in range(p)] if r == root else None
            got = comm.scatterv(chunks, root=root, algorithm=algorithm)
            expected = value(r, rows_of(r + 1), salt)
            np.testing.assert_array_equal(to_numpy(got, use_torch), expected)
            assert to_numpy(got, use_torch).shape == expected.shape
    chunks = [np.arange(j, dtype=np.uint8) for j in range(p)] if r == 0 else "ignored"
    got = comm.scatterv(chunks, async_op=True).wait()
    np.testing.assert_array_equal(got, np.arange(r, dtype=np.uint8))


def a2a_rows(src: int, dst: int) -> int:
    return (src + 2 * dst) % 3


def check_all_to_allv(comm: tcoll.Communicator, use_torch: bool) -> None:
    r, p = comm.rank, comm.size
    for salt, algorithm in enumerate(uneven("all_to_all")):
        chunks = [as_kind(value(r * 10 + j, a2a_rows(r, j), salt), use_torch) for j in range(p)]
        expected = [value(i * 10 + r, a2a_rows(i, r), salt) for i in range(p)]
        assert_list(comm.all_to_allv(chunks, algorithm=algorithm), expected, use_torch, f"all_to_allv {algorithm}")
        work = comm.all_to_allv(chunks, algorithm=algorithm, async_op=True)
        assert_list(work.wait(), expected, use_torch, f"all_to_allv {algorithm} async")
    equal = [as_kind(value(r * 10 + j, 2), use_torch) for j in range(p)]  # equal counts: "auto" may take bruck
    expected = [value(i * 10 + r, 2) for i in range(p)]
    assert_list(comm.all_to_allv(equal), expected, use_torch, "all_to_allv equal")
    empty = [as_kind(np.zeros((0, 2), np.float32), use_torch) for _ in range(p)]
    assert_list(comm.all_to_allv(empty), [np.zeros((0, 2), np.float32)] * p, use_torch, "all_to_allv empty")


def check_reduce_scatterv(comm: tcoll.Communicator, use_torch: bool) -> None:
    r, p = comm.rank, comm.size
    counts = [(2 * j + 1) % 3 for j in range(p)]  # 1, 0, 2, 1, 0, 2, ...
    at = np.cumsum([0] + counts)
    algorithms = ["auto"] + [n for n in runnable(comm, "reduce_scatter")
                             if REGISTRY["reduce_scatter"][n].uneven or len(set(counts)) == 1]
    for salt, algorithm in enumerate(algorithms):
        x_np = value(r, sum(counts), salt)
        x = as_kind(x_np, use_torch)
        total = sum(value(i, sum(counts), salt) for i in range(p))
        got = comm.reduce_scatterv(x, counts, algorithm=algorithm)
        np.testing.assert_array_equal(to_numpy(got, use_torch), total[at[r]:at[r + 1]], err_msg=algorithm)
        np.testing.assert_array_equal(to_numpy(x, use_torch), x_np)  # input left unchanged
    x = as_kind(value(r, sum(counts)), use_torch)
    out = as_kind(np.zeros((counts[r], *TRAILING)), use_torch)
    got = comm.reduce_scatterv(x, counts, op="max", out=out, async_op=True).wait()
    assert got is out
    biggest = np.max([value(i, sum(counts)) for i in range(p)], axis=0)
    np.testing.assert_array_equal(to_numpy(out, use_torch), biggest[at[r]:at[r + 1]])


def check_mismatches(comm: tcoll.Communicator) -> None:
    """Trailing shapes or dtypes that differ between ranks: MismatchError on every rank."""
    r, p = comm.rank, comm.size
    if p == 1:
        return
    odd_shape = np.zeros((1, 3 if r == 0 else 4))
    odd_dtype = np.zeros((2, 3), dtype=np.float32 if r == p - 1 else np.float64)
    calls = [
        lambda: comm.all_gatherv(odd_shape),
        lambda: comm.all_gatherv(odd_dtype),
        lambda: comm.all_gatherv(odd_shape, async_op=True).wait(),
        lambda: comm.gatherv(odd_shape, root=p - 1),
        lambda: comm.gatherv(odd_dtype, root=0, async_op=True).wait(),
        lambda: comm.all_to_allv([odd_shape] * p),
        lambda: comm.all_to_allv([odd_dtype] * p, async_op=True).wait(),
    ]
    for call in calls:
        with pytest.raises(MismatchError, match="trailing shape and dtype must agree"):
            call()


def check_bad_arguments(comm: tcoll.Communicator) -> None:
    """Errors found before anything is sent; the communicator stays usable."""
    p = comm.size
    with pytest.raises(ValueError, match="at least one dimension"):
        comm.all_gatherv(np.array(3.0))
    with pytest.raises(ValueError, match="at least one dimension"):
        comm.gatherv(np.zeros(()))
    with pytest.raises(ValueError, match="chunks"):
        comm.all_to_allv([np.zeros(1)] * (p + 1))
    with pytest.raises(TypeError):
        comm.all_to_allv(np.zeros((p, 2)))
    if p > 1:
        with pytest.raises(ValueError, match="trailing shape and dtype"):
            comm.all_to_allv([np.zeros((1, 2))] + [np.zeros((1, 3))] * (p - 1))
    with pytest.raises(ValueError, match="root"):
        comm.scatterv(None, root=p)
    with pytest.raises(ValueError, match="sum to"):
        comm.reduce_scatterv(np.zeros((p + 1, 2)), [1] * p)
    with pytest.raises(ValueError, match="counts"):
        comm.reduce_scatterv(np.zeros((p, 2)), [1] * (p + 1))
    with pytest.raises(ValueError, match="counts"):
        comm.reduce_scatterv(np.zeros((p, 2)), [-1] + [1] * (p - 1) if p > 1 else [-1])
    with pytest.raises(ValueError, match="unknown"):
        comm.all_gatherv(np.zeros(2), algorithm="nonesuch")
    got = comm.all_gatherv(np.full(1, comm.rank))
    assert [int(g[0]) for g in got] == list(range(p))


def check_torch_bfloat16(comm: tcoll.Communicator) -> None:
    import torch

    x = torch.arange(comm.rank * 2, dtype=torch.bfloat16).reshape(comm.rank, 2)
    got = comm.all_gatherv(x)
    assert all(g.dtype == torch.bfloat16 for g in got)
    for i, g in enumerate(got):
        assert torch.equal(g, torch.arange(i * 2, dtype=torch.bfloat16).reshape(i, 2))


def v_battery(comm: tcoll.Communicator, use_torch: bool = False) -> bool:
    for check in (check_all_gatherv, check_gatherv, check_scatterv, check_all_to_allv, check_reduce_scatterv):
        check(comm, use_torch)
    check_mismatches(comm)
    check_bad_arguments(comm)
    if use_torch:
        check_torch_bfloat16(comm)
    return True


def root_only_error(comm: tcoll.Communicator) -> str:
    """On one rank, a bad chunk list fails on the root alone (nothing was sent)."""
    try:
        comm.scatterv([np.zeros(2), np.zeros(2)])
    except ValueError as exc:
        return str(exc)
    return "accepted"


# -- the tests --------------------------------------------------------------------------------


@pytest.mark.timeout(60)
@pytest.mark.parametrize("size", range(1, 9))
def test_vcollectives_threads_numpy(size: int) -> None:
    assert tcoll.spawn(v_battery, size, threads=True, timeout=60) == [True] * size


@pytest.mark.timeout(60)
@pytest.mark.parametrize("size", [1, 2, 3, 5, 8])
def test_vcollectives_threads_torch(size: int) -> None:
    pytest.importorskip("torch")
    assert tcoll.spawn(v_battery, size, (True,), threads=True, timeout=60) == [True] * size


@pytest.mark.timeout(120)
@pytest.mark.parametrize("transport,size", [("shm", 4), ("tcp", 3)])
def test_vcollectives_processes(transport: str, size: int) -> None:
    # NumPy only: importing torch takes seconds per process on a small machine; thread ranks cover torch.
    assert tcoll.spawn(v_battery, size, timeout=120, transport=transport) == [True] * size


@pytest.mark.timeout(30)
def test_scatterv_checks_chunks_on_root() -> None:
    (message,) = tcoll.spawn(root_only_error, 1, threads=True, timeout=30)
    assert "needs 1 chunks" in message


def large_multichunk(comm: tcoll.Communicator) -> bool:
    """A tiny coll_chunk reaches the pipelined paths of the data phase."""
    r, p = comm.rank, comm.size
    x = value(r, 40 + 17 * r)
    for algorithm in uneven("all_gather"):
        got = comm.all_gatherv(x, algorithm=algorithm)
        assert_list(got, [value(i, 40 + 17 * i) for i in range(p)], False, algorithm)
    chunks = [value(r * 10 + j, 30 + j) for j in range(p)]
    got = comm.all_to_allv(chunks)
    assert_list(got, [value(i * 10 + r, 30 + r) for i in range(p)], False, "all_to_allv")
    return True


@pytest.mark.timeout(60)
@pytest.mark.parametrize("size", [3, 4])
def test_small_chunks(size: int) -> None:
    assert tcoll.spawn(large_multichunk, size, threads=True, timeout=60, coll_chunk="64") == [True] * size
