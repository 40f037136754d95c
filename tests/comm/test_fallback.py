"""A forced algorithm (TCOLL_ALGO) that cannot run a call falls back to the cost model's choice for that call."""

from __future__ import annotations

import functools

import numpy as np
import pytest

import tcoll
from helpers.cases import MATMUL, make_input


def forced_calls(comm: tcoll.Communicator) -> bool:
    r, p = comm.rank, comm.size
    x = make_input(r, 5, np.dtype("int64"), "matmul")
    comm.all_reduce(x, MATMUL)  # ring reorders operands: not for a non-commutative op
    assert np.array_equal(x, functools.reduce(MATMUL.fn, [make_input(i, 5, np.dtype("int64"), "matmul")
                                                          for i in range(p)]))
    y = np.arange(6.0) + r
    comm.all_reduce(y)  # ring runs what it can
    assert np.array_equal(y, sum(np.arange(6.0) + i for i in range(p)))
    for rows in (lambda j: 3, lambda j: j + 1):  # bruck needs equal counts: the uneven call falls back
        got = comm.all_to_allv([np.full(rows(j), r * 10 + j) for j in range(p)])
        assert all(len(got[i]) == rows(r) and (got[i] == i * 10 + r).all() for i in range(p))
    with pytest.raises(ValueError, match="reorders"):
        comm.all_reduce(x, MATMUL, algorithm="ring")  # asked for by name: still an error
    return True


@pytest.mark.timeout(60)
@pytest.mark.parametrize("size", [3, 4])
def test_forced_algorithm_falls_back_when_it_cannot_run(size: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TCOLL_ALGO", "all_reduce=ring,all_to_all=bruck")
    assert tcoll.spawn(forced_calls, size, threads=True, timeout=60) == [True] * size
