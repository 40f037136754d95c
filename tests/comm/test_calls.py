"""The collective API around the algorithms: async calls in flight together, torch tensors,
outputs, module-level functions, and bad arguments rejected before anything is sent."""

from __future__ import annotations

import threading

import numpy as np
import pytest

import tcoll
from helpers.cases import BF16, make_input, reference

SIZES = [1, 2, 3, 5, 8]
P2P_ALL_REDUCE = [a for a in tcoll.algorithms("all_reduce") if a != "shm"]  # async calls run point-to-point


def run_many_async(comm: tcoll.Communicator) -> None:
    """Every collective started async, several of each, waited in a rank-dependent order."""
    p, rank = comm.size, comm.rank
    started = []
    for i, algorithm in enumerate(P2P_ALL_REDUCE * 2):
        x = np.full(37 + i, rank + i, dtype=np.int64)
        started.append((comm.all_reduce(x, algorithm=algorithm, async_op=True),
                        np.full(37 + i, sum(r + i for r in range(p)), dtype=np.int64)))
    y = np.arange(10.0) if rank == p - 1 else np.zeros(10)
    started.append((comm.broadcast(y, root=p - 1, async_op=True), np.arange(10.0)))
    started.append((comm.all_gather(np.array([rank, -rank]), async_op=True),
                    np.array([[r, -r] for r in range(p)])))
    started.append((comm.reduce_scatter(np.ones((2 * p, 3), dtype=np.float32), async_op=True),
                    np.full((2, 3), p, dtype=np.float32)))
    started.append((comm.all_to_all(np.arange(p) + 10 * rank, async_op=True), np.arange(p) * 10 + rank))
    started.append((comm.barrier(async_op=True), None))
    order = list(range(len(started)))
    if rank % 2:
        order.reverse()
    for index in order:
        work, want = started[index]
        got = work.wait(timeout=60)
        if want is not None:
            np.testing.assert_array_equal(got, want)
        assert work.done() and work.exception() is None


@pytest.mark.timeout(120)
@pytest.mark.parametrize("size", SIZES)
def test_async_collectives_in_flight_together(size: int) -> None:
    tcoll.spawn(run_many_async, size, threads=True, timeout=100, coll_chunk="64")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_async_collectives_on_processes(transport: str) -> None:
    tcoll.spawn(run_many_async, 4, timeout=100, transport=transport, coll_chunk="64")


def run_subcomm_concurrency(comm: tcoll.Communicator) -> None:
    """Collectives on the parent, on a split and on a dup, all in flight at once."""
    p, rank = comm.size, comm.rank
    half = comm.split(rank % 2, key=-rank)  # reversed order inside each half
    twin = comm.dup()
    assert half is not None
    members = [r for r in range(p) if r % 2 == rank % 2][::-1]
    assert half.size == len(members) and half.rank == members.index(rank)
    a = np.full(100, rank, dtype=np.int64)
    b = np.full(100, rank, dtype=np.int64)
    c = np.full(100, 1, dtype=np.int64)
    works = [comm.all_reduce(a, async_op=True), half.all_reduce(b, async_op=True),
             twin.all_reduce(c, algorithm=P2P_ALL_REDUCE[-1], async_op=True),
             half.barrier(async_op=True), comm.barrier(async_op=True)]
    for work in (works[::-1] if rank % 3 else works):
        work.wait(timeout=60)
    assert (a == sum(range(p))).all()
    assert (b == sum(members)).all()
    assert (c == p).all()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("size", [1, 2, 3, 6, 7])
def test_sub_communicators_work_concurrently_with_their_parent(size: int) -> None:
    tcoll.spawn(run_subcomm_concurrency, size, threads=True, timeout=100)


def test_sub_communicators_on_shm_processes() -> None:
    tcoll.spawn(run_subcomm_concurrency, 5, timeout=100, transport="shm")


TORCH_DTYPES = ["bool", "int8", "uint8", "int16", "int32", "int64", "float16", "bfloat16", "float32", "float64",
                "complex64", "complex128"]


def run_torch(comm: tcoll.Communicator) -> None:
    import torch

    p, rank = comm.size, comm.rank
    for name in TORCH_DTYPES:
        dtype = getattr(torch, name)
        np_dtype = BF16 if name == "bfloat16" else np.dtype(name)
        inputs = [make_input(r, 2 * p + 1, np_dtype, "max") for r in range(p)]
        as_tensor = (lambda a: torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)) if name == "bfloat16" \
            else torch.from_numpy
        t = as_tensor(inputs[rank].copy())
        if name not in ("complex64", "complex128"):
            assert comm.all_reduce(t, "max") is t
            want = reference("max", inputs)
            assert torch.equal(t, as_tensor(want.copy())), name
        gathered = comm.all_gather(as_tensor(inputs[rank].copy()))
        assert isinstance(gathered, torch.Tensor) and gathered.dtype == dtype and tuple(gathered.shape) == (p, 2 * p + 1)
        assert torch.equal(gathered, as_tensor(np.stack(inputs))), name
        b = as_tensor(inputs[rank].copy())
        comm.broadcast(b, root=p - 1)
        assert torch.equal(b, as_tensor(inputs[p - 1].copy())), name
        chunk = comm.scatter(as_tensor(np.stack(inputs)) if rank == 0 else None, root=0)
        assert isinstance(chunk, torch.Tensor) and torch.equal(chunk, as_tensor(inputs[rank].copy())), name
    grad = torch.ones(4, 3, requires_grad=True)
    comm.all_reduce(grad.data)  # the usual way to reduce a parameter's data in place
    assert torch.equal(grad.detach(), torch.full((4, 3), float(p)))
    s = comm.reduce_scatter(torch.arange(2 * p, dtype=torch.float64), op="avg")
    assert torch.equal(s, torch.arange(2 * rank, 2 * rank + 2, dtype=torch.float64))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("size", [1, 3, 4])
def test_torch_tensors(size: int) -> None:
    pytest.importorskip("torch")
    tcoll.spawn(run_torch, size, threads=True, timeout=100)


def run_outputs(comm: tcoll.Communicator) -> None:
    p, rank = comm.size, comm.rank
    x = np.full((2, 3), rank, dtype=np.float32)
    out = np.empty((p, 2, 3), dtype=np.float32)
    assert comm.all_gather(x, out=out) is out
    np.testing.assert_array_equal(out[:, 0, 0], np.arange(p))
    gathered = comm.gather(x, root=p - 1, out=out)
    assert (gathered is out) if rank == p - 1 else gathered is None
    part = np.empty((1, 3), dtype=np.float32)
    assert comm.reduce_scatter(np.ones((p, 3), dtype=np.float32), out=part) is part
    np.testing.assert_array_equal(part, np.full((1, 3), p))
    mine = np.empty(3, dtype=np.int64)
    assert comm.scatter(np.arange(3 * p).reshape(p, 3) if rank == 0 else None, out=mine) is mine
    np.testing.assert_array_equal(mine, np.arange(3 * rank, 3 * rank + 3))
    listed = comm.scatter([np.full(2, r) for r in range(p)] if rank == 1 % p else None, root=1 % p)
    np.testing.assert_array_equal(listed, [rank, rank])


@pytest.mark.timeout(60)
@pytest.mark.parametrize("size", [1, 3])
def test_outputs_given_and_returned(size: int) -> None:
    tcoll.spawn(run_outputs, size, threads=True, timeout=50)


def run_bad_arguments(comm: tcoll.Communicator) -> None:
    """Each bad call raises on every rank before sending; a good call afterwards still works."""
    p = comm.size
    bad = [
        (TypeError, lambda: comm.all_reduce(np.ones(3), op="band")),
        (TypeError, lambda: comm.all_reduce(np.ones(3, dtype=complex), op="max")),
        (TypeError, lambda: comm.all_reduce(np.ones(3, dtype=np.int32), op="avg")),
        (ValueError, lambda: comm.all_reduce(np.ones(3), op="mean")),
        (ValueError, lambda: comm.all_reduce(np.ones((4, 4))[:, 0])),
        (ValueError, lambda: comm.all_reduce(np.ones(3), algorithm="quantum")),
        (ValueError, lambda: comm.broadcast(np.ones(3), root=p)),
        (ValueError, lambda: comm.reduce(np.ones(3), root=-1)),
        (ValueError, lambda: comm.all_gather(np.ones(3), out=np.empty((p, 4)))),
        (ValueError, lambda: comm.all_to_all(np.ones(p + 1))),
        (ValueError, lambda: comm.reduce_scatter(np.ones(p + 1)) if p > 1 else comm.reduce_scatter(np.ones(())),),
        (ValueError, lambda: comm.all_reduce(np.ones(3), tcoll.Op(np.subtract, commutative=False),
                                             algorithm=_unordered_all_reduce())),
        (TypeError, lambda: comm.all_reduce([1, 2, 3])),
    ]
    if p == 1:  # only the root checks the chunks (the others ignore them)
        bad.append((ValueError, lambda: comm.scatter([np.ones(2)] * (p + 1))))
    for error, call in bad:
        with pytest.raises(error):
            call()
    x = np.ones(3)
    comm.all_reduce(x)
    np.testing.assert_array_equal(x, np.full(3, p))


def _unordered_all_reduce() -> str:
    from tcoll.algos.select import eligible

    unordered = [info.name for info in eligible("all_reduce") if not info.ordered]
    return unordered[0] if unordered else "no such algorithm"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("size", [1, 2, 3])
def test_bad_arguments_raise_before_sending(size: int) -> None:
    tcoll.spawn(run_bad_arguments, size, threads=True, timeout=50)


def run_mismatched_sizes(comm: tcoll.Communicator) -> str:
    try:
        comm.all_reduce(np.ones(10 + comm.rank), algorithm="recursive_doubling", async_op=True).wait(timeout=5)
    except tcoll.MismatchError as exc:
        return f"mismatch: {exc}"
    except tcoll.TimeoutError:
        return "timeout"
    return "no error"


@pytest.mark.timeout(60)
def test_mismatched_sizes_raise_mismatch_error() -> None:
    results = tcoll.spawn(run_mismatched_sizes, 2, threads=True, timeout=50)
    assert all(r != "no error" for r in results) and any(r.startswith("mismatch") for r in results), results


def test_module_level_functions_use_the_default_communicator() -> None:
    comm = tcoll.init()  # a world of one rank
    try:
        x = np.arange(4.0)
        assert tcoll.all_reduce(x) is x
        np.testing.assert_array_equal(tcoll.all_gather(x), x[None])
        assert tcoll.scatter(x[None]).tolist() == x.tolist()
        assert tcoll.barrier() is None
        assert tcoll.split(0).size == 1
    finally:
        comm.close()
    with pytest.raises(RuntimeError, match="init"):
        tcoll.all_reduce(np.ones(1))


def test_algorithms_and_explain() -> None:
    for collective in ("all_reduce", "reduce", "broadcast", "all_gather", "gather", "scatter", "reduce_scatter",
                       "all_to_all", "barrier"):
        assert tcoll.algorithms(collective), collective
    with pytest.raises(ValueError, match="unknown collective"):
        tcoll.algorithms("all_scatter")
    text = tcoll.explain("all_reduce", 64 << 20, 8)
    marks = [line for line in text.splitlines() if line.startswith(" *")]
    one_host = [name for name in tcoll.algorithms("all_reduce") if not name.startswith("hierarchical")]
    assert len(marks) == 1 and all(name in text for name in one_host)
    assert "hierarchical" in tcoll.explain("all_reduce", 64 << 20, 8, hosts=2)


def test_reference_helper_is_independent() -> None:
    """The test reference itself: float sums in float64, integer ops wrapping like the dtype."""
    inputs = [np.array([250], dtype=np.uint8), np.array([10], dtype=np.uint8)]
    assert reference("sum", inputs)[0] == 4
    halves = [np.array([0.1], dtype=np.float16)] * 3
    assert abs(reference("sum", halves)[0] - 3 * float(np.float16(0.1))) < 1e-12


def run_forced(comm: tcoll.Communicator) -> list[str]:
    a, b, c = np.ones(4), np.full(4, comm.rank), np.ones(4)
    names = [comm.all_reduce(a, async_op=True), comm.broadcast(b, async_op=True),
             comm.all_reduce(c, algorithm="ring", async_op=True)]
    for work in names:
        work.wait(timeout=30)
    assert (a == comm.size).all() and (b == 0).all() and (c == comm.size).all()
    return [work.description for work in names]


@pytest.mark.timeout(60)
def test_tcoll_algo_forces_the_auto_choice() -> None:
    descriptions = tcoll.spawn(run_forced, 3, threads=True, timeout=50,
                               algorithms="all_reduce=naive, broadcast=chain")
    for first, second, third in descriptions:
        assert "(naive," in first and "(chain," in second and "(ring," in third
    with pytest.raises(ValueError, match="TCOLL_ALGO"):
        tcoll.spawn(run_forced, 1, threads=True, timeout=50, algorithms="all_reduce")


def run_read_only_root(comm: tcoll.Communicator) -> None:
    for algorithm in tcoll.algorithms("broadcast"):
        x = np.arange(1000.0) if comm.rank == 0 else np.zeros(1000)
        x.flags.writeable = comm.rank != 0  # the root only sends: its buffer may be read-only
        comm.broadcast(x, 0, algorithm=algorithm)
        np.testing.assert_array_equal(x, np.arange(1000.0))
    assert comm.broadcast_object(list(range(100_000)) if comm.rank == 0 else None) == list(range(100_000))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("size", [2, 3, 4])
def test_broadcast_from_a_read_only_root(size: int) -> None:
    tcoll.spawn(run_read_only_root, size, threads=True, timeout=50, coll_chunk="256")


def run_late_messages(comm: tcoll.Communicator, gave_up: threading.Barrier, finished: threading.Event,
                      counted: threading.Barrier) -> tuple:
    """Ranks 1.. time out of an all_gather; rank 0 calls it only then: its messages must go nowhere."""
    out = np.zeros((comm.size, 8), dtype=np.int64)
    if comm.rank == 0:
        gave_up.wait()
        comm.timeout = 1.0
        try:  # it may even complete, from what rank 2 forwarded before it gave up; or learn that the others failed
            comm.all_gather(np.full(8, 1, dtype=np.int64), out=out, algorithm="ring")
        except (tcoll.TimeoutError, tcoll.PeerFailedError):
            pass
        finally:
            finished.set()
        counted.wait()
        try:  # a call that completed here while the others failed: close says so
            comm.close()
        except tcoll.PeerFailedError:
            pass
        return ()
    comm.timeout = 0.3
    # its own timeout, or the notice of the rank that timed out first
    with pytest.raises((tcoll.TimeoutError, tcoll.PeerFailedError), match=r"all_gather #1"):
        comm.all_gather(np.full(8, comm.rank + 1, dtype=np.int64), out=out, algorithm="ring")
    out[:] = 0  # the call failed: the buffer is the user's again
    gave_up.wait()
    while not finished.is_set():
        comm.core.engine.poll()  # take in whatever rank 0 sends meanwhile
    engine = comm.core.engine
    counts = (out.any(), sum(map(len, engine.matcher.posted.values())),
              sum(map(len, engine.matcher.unexpected.values())))
    counted.wait()
    return counts


@pytest.mark.timeout(60)
def test_a_failed_call_withdraws_its_receives_and_drops_late_messages() -> None:
    size = 3
    barriers = (threading.Barrier(size), threading.Event(), threading.Barrier(size))
    results = tcoll.spawn(run_late_messages, size, barriers, threads=True,
                          timeout=50, coll_chunk="16")
    for got in results[1:]:
        assert got == (False, 0, 0), got  # nothing landed in out, nothing left posted or queued


def run_close_while_pending(comm: tcoll.Communicator) -> str:
    if comm.rank != 0:
        return ""
    work = comm.gather(np.ones(4), root=0, algorithm="linear", async_op=True)
    comm.close()  # must not trip over the call's receives being withdrawn meanwhile
    return repr(work.exception())


@pytest.mark.timeout(60)
def test_close_with_a_collective_pending() -> None:
    results = tcoll.spawn(run_close_while_pending, 3, threads=True, timeout=50)
    assert "TcollError" in results[0] or "PeerLostError" in results[0], results
