"""Persistent collectives (comm.<collective>_init) and the lean path of repeated calls.

A plan gives the same results as the ordinary call, run after run, in both
its blocking and started forms; its runs are numbered and stamped like
ordinary calls, so a rank whose plan differs is a MismatchError on every
rank; a buffer the lean path remembered is checked again when it changes.
"""

from __future__ import annotations

import numpy as np
import pytest

import tcoll
from tcoll.comm.plans import LEAN_ENTRIES


def run_every_plan(comm: tcoll.Communicator) -> None:
    """Each collective's plan, run three times on refilled buffers, against NumPy."""
    p, r = comm.size, comm.rank
    x = np.zeros(6, dtype=np.float32)
    plans = {
        "all_reduce": comm.all_reduce_init(x, op="sum"),
        "reduce": comm.reduce_init(y := np.zeros(4), root=p - 1, op="max"),
        "broadcast": comm.broadcast_init(b := np.zeros(3, dtype=np.int64), root=0),
        "all_gather": comm.all_gather_init(g := np.zeros(2, dtype=np.int32)),
        "reduce_scatter": comm.reduce_scatter_init(s := np.zeros((2 * p, 2))),
        "all_to_all": comm.all_to_all_init(a := np.zeros(p, dtype=np.int64)),
        "gather": comm.gather_init(h := np.zeros(2), root=0),
        "scatter": comm.scatter_init(c := (np.zeros((p, 2)) if r == 0 else None), root=0),
        "barrier": comm.barrier_init(),
        "all_gatherv": comm.all_gatherv_init(v := np.zeros(r + 1)),
        "all_to_allv": comm.all_to_allv_init(w := [np.zeros(((r + j) % 3 + 1, 2)) for j in range(p)]),
        "broadcast_object": comm.broadcast_object_init(obj := {"run": 0}, root=0),
    }
    assert plans["all_reduce"].bound and plans["all_gather"].bound and plans["barrier"].bound
    assert not plans["scatter"].bound and not plans["broadcast_object"].bound and not plans["all_to_allv"].bound
    for run in range(3):
        x[...] = r + run
        y[...] = r * run
        b[...] = run if r == 0 else -1
        g[...] = [r, run]
        s[...] = np.arange(4 * p).reshape(2 * p, 2) * (r + 1) + run
        a[...] = np.arange(p) + 10 * r + run
        h[...] = [r, run]
        if r == 0:
            c[...] = np.arange(2 * p).reshape(p, 2) + run
        v[...] = r + run
        for j, chunk in enumerate(w):
            chunk[...] = 100 * r + 10 * j + run
        obj["run"] = run
        started = plans["all_reduce"].start() if run == 1 else None
        got = plans["all_reduce"].wait() if started is not None else plans["all_reduce"]()
        np.testing.assert_array_equal(got, np.full(6, sum(q + run for q in range(p)), dtype=np.float32))
        out = plans["reduce"]()
        if r == p - 1:
            np.testing.assert_array_equal(out, np.full(4, (p - 1) * run))
        np.testing.assert_array_equal(plans["broadcast"](), np.full(3, run))
        np.testing.assert_array_equal(plans["all_gather"](), [[q, run] for q in range(p)])
        want = sum(np.arange(4 * p).reshape(2 * p, 2) * (q + 1) + run for q in range(p))
        np.testing.assert_array_equal(plans["reduce_scatter"](), want[2 * r:2 * r + 2])
        np.testing.assert_array_equal(plans["all_to_all"](), [r + 10 * q + run for q in range(p)])
        out = plans["gather"]()
        if r == 0:
            np.testing.assert_array_equal(out, [[q, run] for q in range(p)])
        np.testing.assert_array_equal(plans["scatter"](), [2 * r + run, 2 * r + 1 + run])
        plans["barrier"]()
        for q, part in enumerate(plans["all_gatherv"]()):
            np.testing.assert_array_equal(part, np.full(q + 1, q + run))
        started = plans["all_to_allv"].start() if run == 2 else None
        got = plans["all_to_allv"].wait() if started is not None else plans["all_to_allv"]()
        for q, part in enumerate(got):
            np.testing.assert_array_equal(part, np.full(((q + r) % 3 + 1, 2), 100 * q + 10 * r + run))
        assert plans["broadcast_object"]() == {"run": run}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("size", [1, 2, 3])
def test_every_plan_gives_the_ordinary_result(size: int) -> None:
    tcoll.spawn(run_every_plan, size, timeout=100)


def run_plan_mismatch(comm: tcoll.Communicator) -> str:
    """Rank 1's plan reduces with another op: every rank's run raises MismatchError, and the next call works."""
    x = np.ones(4, dtype=np.float32)
    plan = comm.all_reduce_init(x, op="max" if comm.rank == 1 else "sum")
    with pytest.raises(tcoll.MismatchError) as info:
        plan()
    comm.barrier()
    np.testing.assert_array_equal(comm.all_reduce(np.ones(2)), np.full(2, comm.size))
    return str(info.value)


@pytest.mark.timeout(120)
def test_a_plan_that_differs_is_a_mismatch_on_every_rank() -> None:
    said = tcoll.spawn(run_plan_mismatch, 3, timeout=100)
    assert all("op=max" in text and "op=sum" in text for text in said), said


def run_lean_changes(comm: tcoll.Communicator) -> None:
    """The lean path: a remembered buffer that changes shape, dtype or writability is checked anew."""
    p = comm.size
    x = np.ones(4, dtype=np.float32)
    for _ in range(3):
        x[...] = 1
        np.testing.assert_array_equal(comm.all_reduce(x), np.full(4, p))
    x.shape = (2, 2)
    x[...] = 1
    np.testing.assert_array_equal(comm.all_reduce(x), np.full((2, 2), p))
    x.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        comm.all_reduce(x)
    many = [np.zeros(2, dtype=np.int64) for _ in range(LEAN_ENTRIES + 3)]  # more than it remembers
    for item in many * 2:
        item[...] = comm.rank
        np.testing.assert_array_equal(comm.all_reduce(item), np.full(2, sum(range(p))))
    y = np.arange(3.0)
    for root in (0, p - 1):
        y[...] = np.arange(3.0) if comm.rank == root else 0
        np.testing.assert_array_equal(comm.broadcast(y, root), np.arange(3.0))


@pytest.mark.timeout(120)
def test_the_lean_path_checks_a_changed_buffer_anew() -> None:
    tcoll.spawn(run_lean_changes, 2, timeout=100)


def run_lean_mismatch(comm: tcoll.Communicator) -> None:
    """A remembered call on one rank against a different call on another: MismatchError on both."""
    x = np.ones(8, dtype=np.float32)
    for _ in range(3):
        comm.all_reduce(x)
    other = np.ones(8 if comm.rank == 0 else 9, dtype=np.float32)
    with pytest.raises(tcoll.MismatchError):
        comm.all_reduce(x if comm.rank == 0 else other)
    comm.barrier()
    x[...] = 1
    np.testing.assert_array_equal(comm.all_reduce(x), np.full(8, comm.size))


@pytest.mark.timeout(120)
def test_a_remembered_call_still_meets_a_mismatch() -> None:
    tcoll.spawn(run_lean_mismatch, 2, timeout=100)


def test_a_plan_takes_no_async_op() -> None:
    def body(comm: tcoll.Communicator) -> None:
        with pytest.raises(TypeError, match="async_op"):
            comm.all_reduce_init(np.ones(2), async_op=True)

    tcoll.spawn(body, 1, threads=True, timeout=30)
