"""What the ranks of the torch backend tests run (module-level, so torch.multiprocessing can spawn them).

Every rank computes, for each call, the reference result from every rank's
known input (rank r's data is `data(r, ...)`), in this one process, and
asserts the backend produced it. A failed assertion fails the rank, which
fails the spawn with the rank's traceback.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import os
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

import tcoll.torch  # registers the backend (the entry point does too)

R = dist.ReduceOp
FLOATS = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.float8_e4m3fn]
INTS = [torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8, torch.uint16, torch.uint32, torch.uint64]
SHAPES = [(5,), (2, 3), (0,), (), (7, 1, 2)]


def init(rank: int, size: int, port: int, backend: str = "tcoll") -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group(backend, rank=rank, world_size=size, timeout=datetime.timedelta(seconds=120))


def data(r: int, shape: tuple[int, ...], dtype: torch.dtype, salt: int = 0, small: bool = False) -> torch.Tensor:
    """Rank r's input: small integers (exact in every dtype), 1..3 when `small` (for products)."""
    n = 1
    for d in shape:
        n *= d
    idx = torch.arange(n, dtype=torch.int64)
    if small:
        raw = (idx * 5 + r * 3 + salt) % 3 + 1
    elif dtype == torch.bool:
        raw = (idx * 5 + r * 3 + salt) % 3 == 0
    elif dtype.is_floating_point or dtype.is_complex or dtype in (torch.int8, torch.int16, torch.int32, torch.int64):
        raw = (idx * 7 + r * 13 + salt) % 11 - 5
    else:
        raw = (idx * 7 + r * 13 + salt) % 11
    out = raw.to(torch.float32).to(dtype) if dtype.is_floating_point else raw.to(dtype)
    return out.reshape(shape)


def expected(op: Any, inputs: list[torch.Tensor], size: int) -> torch.Tensor:
    """The reduction of `inputs` (one per rank) under torch ReduceOp `op`, computed wide then cast."""
    dtype = inputs[0].dtype
    kind = getattr(op, "op", op)
    if dtype == torch.bool:
        stack = torch.stack(inputs)
        table = {R.SUM: stack.any(0), R.PRODUCT: stack.all(0), R.MIN: stack.all(0), R.MAX: stack.any(0),
                 R.BAND: stack.all(0), R.BOR: stack.any(0),
                 R.BXOR: functools.reduce(torch.logical_xor, inputs, torch.zeros_like(inputs[0]))}
        return table[kind]
    wide_dtype = torch.float64 if (dtype.is_floating_point or dtype.is_complex) else torch.int64
    if dtype.is_complex:
        wide_dtype = torch.complex128
    wide = [t.to(wide_dtype) for t in inputs]
    stack = torch.stack(wide)
    if kind == R.SUM:
        out = stack.sum(0)
    elif kind == R.PRODUCT:
        out = stack.prod(0)
    elif kind == R.MIN:
        out = stack.amin(0)
    elif kind == R.MAX:
        out = stack.amax(0)
    elif kind == R.AVG:
        out = stack.sum(0) / size if wide_dtype != torch.int64 else torch.div(stack.sum(0), size, rounding_mode="trunc")
    elif kind == R.PREMUL_SUM:
        out = (stack * op.factor if not isinstance(op.factor, torch.Tensor) else stack * op.factor.double()).sum(0)
    else:
        fn = {R.BAND: torch.bitwise_and, R.BOR: torch.bitwise_or, R.BXOR: torch.bitwise_xor}[kind]
        out = functools.reduce(fn, wide)
    return out.to(dtype)


def same(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert got.shape == want.shape and got.dtype == want.dtype, \
        f"{what}: {got.shape} {got.dtype} vs {want.shape} {want.dtype}"
    if got.dtype.is_floating_point and got.dtype.itemsize == 1:
        got, want = got.float(), want.float()
    if got.dtype.is_floating_point or got.dtype.is_complex:
        tol = 1e-2 if got.element_size() <= 2 else 1e-6
        assert torch.allclose(got, want, rtol=tol, atol=tol), f"{what}: got {got} want {want}"
    else:
        assert torch.equal(got, want), f"{what}: got {got} want {want}"


def ops_for(dtype: torch.dtype) -> list[Any]:
    if dtype == torch.bool:
        return [R.SUM, R.PRODUCT, R.MIN, R.MAX, R.BAND, R.BOR, R.BXOR]
    if dtype.is_floating_point:
        return [R.SUM, R.PRODUCT, R.MIN, R.MAX, R.AVG, dist._make_nccl_premul_sum(2.0),
                dist._make_nccl_premul_sum(torch.tensor([0.5]))]
    return [R.SUM, R.PRODUCT, R.MIN, R.MAX, R.AVG, R.BAND, R.BOR, R.BXOR, dist._make_nccl_premul_sum(3.0)]


def wait(work: Any, async_op: bool) -> None:
    if async_op:
        assert work is not None
        work.wait()
        assert work.is_completed()


# -- the collectives, every op and dtype -----------------------------------------------------------


def check_reductions(rank: int, size: int, async_op: bool) -> None:
    """all_reduce, reduce (every root), reduce_scatter (list and tensor): every op, every dtype."""
    for dtype in [*FLOATS, *INTS, torch.bool]:
        for op in ops_for(dtype):
            kind = getattr(op, "op", op)
            small = kind == R.PRODUCT
            shape = (3, 2)
            inputs = [data(r, shape, dtype, 1, small) for r in range(size)]
            what = f"{dtype} {kind} async={async_op}"
            t = inputs[rank].clone()
            wait(dist.all_reduce(t, op=op, async_op=async_op), async_op)
            same(t, expected(op, inputs, size), f"all_reduce {what}")
            root = len(what) % size  # the same on every rank, and each rank the root of some calls
            t = inputs[rank].clone()
            wait(dist.reduce(t, dst=root, op=op, async_op=async_op), async_op)
            same(t, expected(op, inputs, size) if rank == root else inputs[rank], f"reduce {what} root {root}")
            rows = [data(r, (size * 2, 3), dtype, 2, small) for r in range(size)]
            out = torch.empty((2, 3), dtype=dtype)
            wait(dist.reduce_scatter_tensor(out, rows[rank].clone(), op=op, async_op=async_op), async_op)
            same(out, expected(op, rows, size)[2 * rank:2 * rank + 2], f"reduce_scatter_tensor {what}")
            if dtype == torch.float32 or dtype == torch.int32:
                parts = [list(torch.split(x, 2)) for x in rows]
                out = torch.empty((2, 3), dtype=dtype)
                wait(dist.reduce_scatter(out, [p.clone() for p in parts[rank]], op=op, async_op=async_op), async_op)
                same(out, expected(op, rows, size)[2 * rank:2 * rank + 2], f"reduce_scatter {what}")
    for dtype in [torch.complex64, torch.complex128]:
        for op in [R.SUM, R.AVG]:
            inputs = [data(r, (4,), torch.float64).to(dtype) * (1 + 1j) for r in range(size)]
            t = inputs[rank].clone()
            wait(dist.all_reduce(t, op=op, async_op=async_op), async_op)
            same(t, expected(op, inputs, size), f"all_reduce {dtype} {op}")


def check_reduce_roots_and_shapes(rank: int, size: int) -> None:
    """reduce with every root (the others' tensors left as they were); odd shapes; non-contiguous tensors."""
    for root in range(size):
        for shape in SHAPES:
            inputs = [data(r, shape, torch.float32, root) for r in range(size)]
            t = inputs[rank].clone()
            dist.reduce(t, dst=root)
            same(t, torch.stack(inputs).sum(0) if rank == root else inputs[rank], f"reduce root {root} shape {shape}")
            t = inputs[rank].clone()
            dist.all_reduce(t, op=R.MAX)
            same(t, torch.stack(inputs).amax(0), f"all_reduce max shape {shape}")
    big = [data(r, (64, 48), torch.float64, 5) for r in range(size)]
    t = big[rank].clone().t()  # not contiguous
    dist.all_reduce(t)
    same(t, torch.stack(big).sum(0).t(), "all_reduce non-contiguous")
    t = big[rank].clone()
    dist.reduce(t, dst=0)
    if rank == 0:
        same(t, torch.stack(big).sum(0), "reduce multi-chunk")  # TCOLL_COLL_CHUNK is small in the test


def check_movement(rank: int, size: int, async_op: bool) -> None:
    """broadcast, all_gather (list, tensor, uneven), gather, scatter, all_to_all (single, list, uneven)."""
    for dtype in [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.bool, torch.uint8,
                  torch.complex64, torch.float8_e5m2, torch.uint32]:
        tag = f"{dtype} async={async_op}"
        for root in range(size):
            t = data(rank, (3, 2), dtype, root) if rank == root else torch.zeros((3, 2), dtype=dtype)
            wait(dist.broadcast(t, src=root, async_op=async_op), async_op)
            same(t, data(root, (3, 2), dtype, root), f"broadcast root {root} {tag}")
        outs = [torch.empty((2, 2), dtype=dtype) for _ in range(size)]
        wait(dist.all_gather(outs, data(rank, (2, 2), dtype), async_op=async_op), async_op)
        for r in range(size):
            same(outs[r], data(r, (2, 2), dtype), f"all_gather {tag}")
        out = torch.empty((size * 2, 3), dtype=dtype)
        wait(dist.all_gather_into_tensor(out, data(rank, (2, 3), dtype), async_op=async_op), async_op)
        same(out, torch.cat([data(r, (2, 3), dtype) for r in range(size)]), f"all_gather_into_tensor {tag}")
        root = size - 1
        gathered = [torch.empty(3, dtype=dtype) for _ in range(size)] if rank == root else None
        wait(dist.gather(data(rank, (3,), dtype), gathered, dst=root, async_op=async_op), async_op)
        if rank == root:
            for r in range(size):
                same(gathered[r], data(r, (3,), dtype), f"gather {tag}")
        chunks = [data(r, (2,), dtype, 9) for r in range(size)] if rank == 0 else None
        got = torch.empty(2, dtype=dtype)
        wait(dist.scatter(got, chunks, src=0, async_op=async_op), async_op)
        same(got, data(rank, (2,), dtype, 9), f"scatter {tag}")
        send = torch.cat([data(rank * size + j, (2,), dtype) for j in range(size)])
        recv = torch.empty(2 * size, dtype=dtype)
        wait(dist.all_to_all_single(recv, send, async_op=async_op), async_op)
        same(recv, torch.cat([data(i * size + rank, (2,), dtype) for i in range(size)]), f"all_to_all_single {tag}")
    # uneven: rank r sends (r + j) % 3 rows of 2 to rank j
    rows = lambda i, j: (i + j) % 3  # noqa: E731
    send = torch.cat([data(rank * 10 + j, (rows(rank, j), 2), torch.float32) for j in range(size)])
    recv = torch.empty((sum(rows(i, rank) for i in range(size)), 2))
    wait(dist.all_to_all_single(recv, send, [rows(i, rank) for i in range(size)], [rows(rank, j) for j in range(size)],
                                async_op=async_op), async_op)
    same(recv, torch.cat([data(i * 10 + rank, (rows(i, rank), 2), torch.float32) for i in range(size)]),
         "all_to_all_single uneven")
    outs = [torch.empty((rows(i, rank), 2)) for i in range(size)]
    wait(dist.all_to_all(outs, [data(rank * 10 + j, (rows(rank, j), 2), torch.float32) for j in range(size)],
                         async_op=async_op), async_op)
    for i in range(size):
        same(outs[i], data(i * 10 + rank, (rows(i, rank), 2), torch.float32), "all_to_all list uneven")
    outs = [torch.empty(r + 1, dtype=torch.int32) for r in range(size)]
    wait(dist.all_gather(outs, data(rank, (rank + 1,), torch.int32), async_op=async_op), async_op)
    for r in range(size):
        same(outs[r], data(r, (r + 1,), torch.int32), "all_gather uneven")
    parts = [data(r, (size * 3,), torch.float32, 4) for r in range(size)]
    counts = [j + 1 for j in range(size)]
    total = sum(counts)
    inputs = [data(r, (total,), torch.float32, 4) for r in range(size)]
    out = torch.empty(counts[rank])
    pieces = list(torch.split(inputs[rank], counts))
    wait(dist.reduce_scatter(out, pieces, async_op=async_op), async_op)
    start = sum(counts[:rank])
    same(out, torch.stack(inputs).sum(0)[start:start + counts[rank]], "reduce_scatter uneven")
    del parts
    wait(dist.barrier(async_op=async_op), async_op)


def check_p2p(rank: int, size: int) -> None:
    """send/recv, isend/irecv, any-source recv, batch_isend_irecv, tags."""
    nxt, prv = (rank + 1) % size, (rank - 1) % size
    for dtype in [torch.float32, torch.bfloat16, torch.int64, torch.bool]:
        out = torch.empty((3, 4), dtype=dtype)
        req = dist.isend(data(rank, (3, 4), dtype), nxt)
        dist.recv(out, prv)
        req.wait()
        same(out, data(prv, (3, 4), dtype), f"isend/recv {dtype}")
    big = torch.empty(300_000)  # larger than the eager limit: needs the receive posted
    reqs = [dist.irecv(big, prv, tag=7), dist.isend(torch.full((300_000,), float(rank)), nxt, tag=7)]
    for req in reqs:
        req.wait()
    assert torch.all(big == prv)
    out = torch.empty(2)
    ops = [dist.P2POp(dist.isend, torch.full((2,), rank + 0.5), nxt, tag=3),
           dist.P2POp(dist.irecv, out, prv, tag=3)]
    for req in dist.batch_isend_irecv(ops):
        req.wait()
    assert torch.all(out == prv + 0.5)
    a, b = torch.empty(1), torch.empty(1)  # tags keep messages apart
    sends = [dist.isend(torch.tensor([1.0 * rank]), nxt, tag=1), dist.isend(torch.tensor([2.0 * rank]), nxt, tag=2)]
    dist.recv(b, prv, tag=2)
    dist.recv(a, prv, tag=1)
    for s in sends:
        s.wait()
    assert a.item() == prv and b.item() == 2.0 * prv
    t = torch.zeros(4, 4)[:, 1]  # non-contiguous receive
    dist.barrier()
    req = dist.isend(torch.arange(4.0) + rank, nxt)
    dist.recv(t, prv)
    req.wait()
    assert torch.equal(t, torch.arange(4.0) + prv)
    # any source: every other rank sends to rank 0 once, rank 0 receives them all
    if size == 1:
        pass
    elif rank == 0:
        seen = []
        for _ in range(size - 1):
            got = torch.empty(1)
            src = dist.recv(got, tag=11)
            assert got.item() == src * 10.0, (src, got)
            seen.append(src)
        assert sorted(seen) == list(range(1, size)), seen
        req = dist.irecv(torch.empty(1), tag=12)
        req.wait()
        assert req._source_rank() in range(1, size)
        for _ in range(size - 2):  # the others, now from the stash or the wire
            dist.recv(torch.empty(1), tag=12)
    else:
        dist.send(torch.tensor([rank * 10.0]), 0, tag=11)
        dist.send(torch.tensor([rank * 1.0]), 0, tag=12)
    dist.barrier()


def check_objects_groups(rank: int, size: int) -> None:
    """Object collectives, subgroups, coalescing, functional collectives, sequence numbers."""
    objs: list[Any] = [None] * size
    dist.all_gather_object(objs, {"rank": rank, "pad": "x" * rank * 100})
    assert objs == [{"rank": r, "pad": "x" * r * 100} for r in range(size)]
    lst = [f"hello {rank}", [rank] * 3] if rank == 1 % size else [None, None]
    dist.broadcast_object_list(lst, src=1 % size)
    assert lst == [f"hello {1 % size}", [1 % size] * 3]
    gathered = [None] * size if rank == 0 else None
    dist.gather_object(("r", rank), gathered, dst=0)
    if rank == 0:
        assert gathered == [("r", r) for r in range(size)]
    got: list[Any] = [None]
    dist.scatter_object_list(got, [{"to": r} for r in range(size)] if rank == 0 else None, src=0)
    assert got == [{"to": rank}]
    seq = dist.group.WORLD._get_sequence_number_for_group()
    assert isinstance(seq, int) and seq > 0
    # subgroups: the even ranks, and new_subgroups of 2 (or the whole world)
    evens = dist.new_group([r for r in range(size) if r % 2 == 0])
    odd_then_even = dist.new_group(list(range(size))[::-1])
    if rank % 2 == 0:
        t = torch.tensor([float(rank)])
        dist.all_reduce(t, group=evens)
        assert t.item() == sum(r for r in range(size) if r % 2 == 0)
        assert dist.get_backend(evens) == "tcoll"
        objs = [None] * dist.get_world_size(evens)
        dist.all_gather_object(objs, rank, group=evens)
        assert objs == [r for r in range(size) if r % 2 == 0]
    t = torch.tensor([float(rank)])
    dist.broadcast(t, src=size - 1, group=odd_then_even)
    assert t.item() == size - 1
    sub, subgroups = dist.new_subgroups(group_size=2 if size % 2 == 0 else size)
    t = torch.tensor([1.0 + rank])
    dist.all_reduce(t, group=sub)
    members = dist.get_process_group_ranks(sub)
    assert t.item() == sum(1.0 + r for r in members), (t, members)
    # the coalescing manager and the deprecated coalesced calls
    tensors = [data(rank, (n,), torch.float32, n) for n in (3, 1, 4)]
    with dist._coalescing_manager(async_ops=True) as cm:
        for t in tensors:
            dist.all_reduce(t)
    cm.wait()
    for t, n in zip(tensors, (3, 1, 4), strict=True):
        same(t, torch.stack([data(r, (n,), torch.float32, n) for r in range(size)]).sum(0), "coalesced all_reduce")
    outs = [torch.empty(size * 2) for _ in range(2)]
    with dist._coalescing_manager():
        for k, o in enumerate(outs):
            dist.all_gather_into_tensor(o, data(rank, (2,), torch.float32, k))
    for k, o in enumerate(outs):
        same(o, torch.cat([data(r, (2,), torch.float32, k) for r in range(size)]), "coalesced all_gather")
    outs = [torch.empty(2) for _ in range(2)]
    with dist._coalescing_manager():
        for k, o in enumerate(outs):
            dist.reduce_scatter_tensor(o, data(rank, (size * 2,), torch.float32, k))
    for k, o in enumerate(outs):
        want = torch.stack([data(r, (size * 2,), torch.float32, k) for r in range(size)]).sum(0)
        same(o, want[2 * rank:2 * rank + 2], "coalesced reduce_scatter")
    mixed = [torch.ones(2) * rank, torch.ones(3) * rank]
    dist.all_reduce_coalesced(mixed)
    assert mixed[0].tolist() == [sum(range(size))] * 2 and mixed[1].tolist() == [sum(range(size))] * 3
    # functional collectives (C++ dispatch by group name)
    import torch.distributed._functional_collectives as fc

    r = fc.all_reduce(torch.ones(3) * rank, "sum", dist.group.WORLD)
    assert torch.equal(r.wait() if hasattr(r, "wait") else r, torch.full((3,), float(sum(range(size)))))
    g = fc.all_gather_single(torch.tensor([float(rank)]), 0, dist.group.WORLD)
    assert torch.equal(torch.as_tensor(g), torch.arange(float(size)))
    rs = fc.reduce_scatter_single(torch.arange(2.0 * size), "sum", 0, dist.group.WORLD)
    assert torch.equal(torch.as_tensor(rs), torch.arange(2.0 * size)[2 * rank:2 * rank + 2] * size)
    a2a = fc.all_to_all_single(torch.arange(float(size)) + 10 * rank, None, None, dist.group.WORLD)
    assert torch.equal(torch.as_tensor(a2a), torch.arange(float(size)) * 10 + rank)
    # zero-copy tensors: shared memory the collectives read in place
    zc = tcoll.torch.empty((3, 2), torch.bfloat16)
    assert zc.shape == (3, 2) and zc.dtype == torch.bfloat16 and torch.all(zc == 0)
    zc.copy_(data(rank, (3, 2), torch.bfloat16))
    dist.all_reduce(zc)
    same(zc, expected(R.SUM, [data(r, (3, 2), torch.bfloat16) for r in range(size)], size), "all_reduce zero-copy")
    big = tcoll.torch.empty(1 << 16)
    big.fill_(rank)
    dist.all_reduce(big, op=R.MAX)
    assert torch.all(big == size - 1)
    # futures and Work
    work = dist.all_reduce(torch.ones(2), async_op=True)
    fut = work.get_future()
    assert torch.equal(fut.wait()[0], torch.full((2,), float(size)))
    chained = dist.all_reduce(torch.ones(1), async_op=True).get_future().then(lambda f: f.value()[0] * 2)
    assert chained.wait().item() == 2.0 * size
    assert work.is_success() and work.exception() is None
    check_failed_work()


class _Failing:
    """A tcoll Work stand-in that has failed."""

    error = tcoll.PeerLostError(7, "gone for the test")

    def wait(self, timeout: float | None = None) -> None:
        raise self.error

    def done(self) -> bool:
        return True

    def exception(self) -> BaseException:
        return self.error


def check_failed_work() -> None:
    """A failed operation raises from wait() and get_future(); its Future is never completed with the error."""
    from tcoll.torch.work import TcollWork

    for first in ("wait", "get_future"):
        work = TcollWork(dist.group.WORLD, [torch.ones(1)], [_Failing()])
        for name in (first, "wait", "get_future"):
            try:
                getattr(work, name)()
            except tcoll.PeerLostError as exc:
                assert "rank 7" in str(exc)
            else:
                raise AssertionError(f"{name}() of a failed Work did not raise")
        assert work.is_completed() and not work.is_success() and work.exception() is _Failing.error


def check_repeated_all_reduce(rank: int, size: int) -> None:
    """The same tensors all-reduced again and again (the backend keeps a plan per small tensor): new contents,
    other ops, other dtypes and shapes over the same memory, tensors freed and made anew, more than it keeps."""
    base = torch.zeros(64)
    for step, op in enumerate((R.SUM, R.MAX, R.SUM, R.MIN, R.PRODUCT, R.SUM)):
        small = op == R.PRODUCT
        base.copy_(data(rank, (64,), torch.float32, salt=step, small=small))  # new contents, same memory
        dist.all_reduce(base, op=op)
        want = expected(op, [data(r, (64,), torch.float32, salt=step, small=small) for r in range(size)], size)
        same(base, want, f"repeated all_reduce step {step} {op}")
    for what, view in (("int32 view", base.view(torch.int32)), ("2-d view", base.view(8, 8)),
                       ("first half", base[:32]), ("second half", base[32:])):
        view.copy_(data(rank, tuple(view.shape), view.dtype, salt=len(what)))
        dist.all_reduce(view)
        want = expected(R.SUM, [data(r, tuple(view.shape), view.dtype, salt=len(what)) for r in range(size)], size)
        same(view, want, f"all_reduce of the {what} of a reduced tensor")
    blocking = dist.AllreduceOptions()
    blocking.asyncOp = False  # called directly (not by dist.all_reduce): a Work, complete, with its outputs
    base.fill_(float(rank))
    work = dist.group.WORLD.allreduce([base], blocking)
    assert work is not None and work.is_completed() and work.wait()
    same(work.get_future().value()[0], torch.full((64,), float(sum(range(size)))), "direct blocking allreduce")
    for i in range(40):  # more tensors than plans kept; freed ones' memory comes back as new tensors
        dtype = (torch.float32, torch.int64, torch.float64)[i % 3]
        t = data(rank, (3 + i % 5,), dtype, salt=i)
        dist.all_reduce(t)
        same(t, expected(R.SUM, [data(r, (3 + i % 5,), dtype, salt=i) for r in range(size)], size),
             f"all_reduce of fresh tensor {i}")


def check_repeated_gathers(rank: int, size: int) -> None:
    """all_gather_into_tensor, reduce_scatter_tensor, all_gather into lists, all_to_all_single, reduce and
    broadcast again and again on the same tensors (the backend keeps their NumPy views, so tcoll repeats the call in C): new contents each time,
    earlier results unchanged, another dtype over the same memory, a fresh output, more tensors than kept."""
    inp, out = torch.zeros(6), torch.zeros(6 * size)
    parts, part = torch.zeros(4 * size), torch.zeros(4)
    for step in range(6):
        inp.copy_(data(rank, (6,), torch.float32, salt=step))
        dist.all_gather_into_tensor(out, inp)
        same(out, torch.cat([data(r, (6,), torch.float32, salt=step) for r in range(size)]), f"all_gather {step}")
        parts.copy_(data(rank, (4 * size,), torch.float32, salt=step))
        dist.reduce_scatter_tensor(part, parts)
        total = expected(R.SUM, [data(r, (4 * size,), torch.float32, salt=step) for r in range(size)], size)
        same(part, total[4 * rank:4 * rank + 4], f"reduce_scatter {step}")
    kept_lists = []
    for step in range(5):  # all_gather into lists of tensors: a fresh list each time, the earlier ones unchanged
        inp.copy_(data(rank, (6,), torch.float32, salt=30 + step))
        rows = [torch.empty(6) for _ in range(size)]
        dist.all_gather(rows, inp)
        kept_lists.append((rows, [data(r, (6,), torch.float32, salt=30 + step) for r in range(size)]))
    for step, (rows, want) in enumerate(kept_lists):
        for r in range(size):
            same(rows[r], want[r], f"all_gather into a list {step}, row {r}")
    swapped = torch.zeros(4 * size)
    for step in range(4):  # reduce and all_to_all_single on the same tensors, new contents each time
        root = step % size
        parts.copy_(data(rank, (4 * size,), torch.float32, salt=40 + step))
        dist.all_to_all_single(swapped, parts)
        same(swapped, torch.cat([data(r, (4 * size,), torch.float32, salt=40 + step)[4 * rank:4 * rank + 4]
                                 for r in range(size)]), f"repeated all_to_all_single {step}")
        dist.reduce(parts, root)
        if rank == root:
            same(parts, expected(R.SUM, [data(r, (4 * size,), torch.float32, salt=40 + step) for r in range(size)],
                                 size), f"repeated reduce {step} to {root}")
    for step in range(4):  # broadcast of the same tensor, from each root in turn
        root = step % size
        inp.copy_(data(rank, (6,), torch.float32, salt=20 + step))
        dist.broadcast(inp, root)
        same(inp, data(root, (6,), torch.float32, salt=20 + step), f"repeated broadcast {step} from {root}")
    as_int = inp.view(torch.int32)
    as_int.copy_(data(rank, (6,), torch.int32, salt=9))
    wide = torch.zeros(6 * size, dtype=torch.int32)
    dist.all_gather_into_tensor(wide, as_int)
    same(wide, torch.cat([data(r, (6,), torch.int32, salt=9) for r in range(size)]), "all_gather of an int32 view")
    for i in range(70):  # more than the views kept; freed tensors' memory comes back as new tensors
        x, got = data(rank, (2 + i % 3,), torch.float64, salt=i), torch.empty((2 + i % 3) * size, dtype=torch.float64)
        dist.all_gather_into_tensor(got, x)
        same(got, torch.cat([data(r, (2 + i % 3,), torch.float64, salt=i) for r in range(size)]), f"fresh {i}")


def check_shut_down_group(rank: int, size: int) -> None:
    """A group that was shut down says so, in the fast path of all_reduce too; the world goes on."""
    group = dist.new_group(list(range(size)))
    t = torch.ones(4)
    dist.all_reduce(t, group=group)
    group.shutdown()
    try:
        dist.all_reduce(t, group=group)
    except tcoll.TcollError as exc:
        assert "shut down" in str(exc), str(exc)
    else:
        raise AssertionError("all_reduce on a group that was shut down returned")
    dist.all_reduce(t)
    same(t, torch.full((4,), float(size * size)), "all_reduce on the world after a subgroup's shutdown")


def collectives(rank: int, size: int, port: int) -> None:
    """The whole collective and point-to-point suite, blocking and with async_op, in both call modes."""
    init(rank, size, port)
    assert dist.get_backend() == "tcoll" and dist.get_rank() == rank and dist.get_world_size() == size
    check_reduce_roots_and_shapes(rank, size)
    for mode in ("0", "1"):  # collectives run blocking; then started async when async_op=True
        os.environ["TCOLL_TORCH_ASYNC"] = mode
        for async_op in (False, True):
            check_reductions(rank, size, async_op)
            check_movement(rank, size, async_op)
    os.environ["TCOLL_TORCH_ASYNC"] = "0"
    check_p2p(rank, size)
    check_objects_groups(rank, size)
    dist.destroy_process_group()


def collectives_quick(rank: int, size: int, port: int) -> None:
    """The suite with blocking calls only (the other rank counts and transports)."""
    init(rank, size, port)
    check_reduce_roots_and_shapes(rank, size)
    check_reductions(rank, size, False)
    check_repeated_all_reduce(rank, size)
    check_repeated_gathers(rank, size)
    check_movement(rank, size, False)
    check_p2p(rank, size)
    check_objects_groups(rank, size)
    check_shut_down_group(rank, size)
    dist.destroy_process_group()


START_METHOD = "forkserver"  # ranks fork from a server that imported torch once, instead of each importing it


def spawn(fn: Callable[..., None], size: int, *args: Any) -> None:
    """Run fn(rank, size, *args) on `size` new processes; raises if any fails."""
    import multiprocessing

    import torch.multiprocessing as mp

    multiprocessing.set_forkserver_preload(["numpy", "torch", "tcoll"])
    mp.start_processes(fn, args=(size, *args), nprocs=size, join=True, start_method=START_METHOD)


# -- DDP and FSDP2 against training in one process ------------------------------------------------

BATCH, STEPS, LR = 4, 4, 0.1


class Net(torch.nn.Module):
    """A small MLP; `spare` is used only when `use_spare` (for find_unused_parameters)."""

    def __init__(self, use_spare: bool = True) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.first = torch.nn.Linear(6, 12)
        self.second = torch.nn.Linear(12, 3)
        self.spare = torch.nn.Linear(12, 3)
        self.use_spare = use_spare

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.first(x))
        out = self.second(h)
        return out + self.spare(h) if self.use_spare else out


def batch(step: int, rank: int, micro: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + 10 * rank + micro)
    x = torch.randn(BATCH, 6, generator=g, dtype=torch.float64)
    return x, torch.randn(BATCH, 3, generator=g, dtype=torch.float64)


def local_grads(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> list[torch.Tensor]:
    model.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    return [torch.zeros_like(p) if p.grad is None else p.grad.clone() for p in model.parameters()]


Weights = list[torch.Tensor]


def reference(size: int, steps: list[int], use_spare: bool = True, micro: int = 1) -> tuple[list[Weights], Weights]:
    """Training in this process: each step's gradient is (1/size) * the sum of the active ranks' local gradients.

    Rank r takes part in steps[r] steps (Join); `micro` micro-batches are accumulated per step (no_sync).

    Returns:
        (the gradient of every step, the final weights).
    """
    model = Net(use_spare).double()
    grads_per_step = []
    for step in range(max(steps)):
        total = [torch.zeros_like(p) for p in model.parameters()]
        for r in range(size):
            if step < steps[r]:
                for m in range(micro):
                    for t, g in zip(total, local_grads(model, *batch(step, r, m)), strict=True):
                        t += g / size
        with torch.no_grad():
            for p, g in zip(model.parameters(), total, strict=True):
                p -= LR * g
        grads_per_step.append(total)
    return grads_per_step, [p.detach().clone() for p in model.parameters()]


def train_ddp(rank: int, size: int, *, use_spare: bool = True, steps: int = STEPS, micro: int = 1, join: bool = False,
              hook: Callable[..., Any] | None = None, **ddp_kwargs: Any) -> tuple[list[Weights], Weights]:
    """Train DDP(Net) with SGD; returns every step's gradients (as DDP left them) and the final weights."""
    from torch.distributed.algorithms.join import Join
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = DDP(Net(use_spare).double(), **ddp_kwargs)
    if hook is not None:
        model.register_comm_hook(dist.group.WORLD, hook)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    grads = []
    context = Join([model]) if join else contextlib.nullcontext()
    with context:
        for step in range(steps):
            opt.zero_grad()
            for m in range(micro - 1):
                with model.no_sync():
                    torch.nn.functional.mse_loss(model(batch(step, rank, m)[0]), batch(step, rank, m)[1]).backward()
            x, y = batch(step, rank, micro - 1)
            torch.nn.functional.mse_loss(model(x), y).backward()
            grads.append([torch.zeros_like(p) if p.grad is None else p.grad.clone() for p in model.parameters()])
            opt.step()
    return grads, [p.detach().clone() for p in model.parameters()]


def close(got: list[torch.Tensor], want: list[torch.Tensor], what: str, tol: float = 1e-10) -> None:
    for a, b in zip(got, want, strict=True):
        assert torch.allclose(a, b, rtol=tol, atol=tol), f"{what}: max difference {(a - b).abs().max().item()}"


def ddp(rank: int, size: int, port: int) -> None:
    """Every DDP variant of the issue, each checked against `reference`."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    if not dist.is_initialized():
        init(rank, size, port)
    full = [STEPS] * size
    want_grads, want_weights = reference(size, full)
    variants: dict[str, dict[str, Any]] = {
        "default buckets": {},
        "tiny buckets": {"bucket_cap_mb": 0.0001},
        "gradient_as_bucket_view": {"gradient_as_bucket_view": True},
        "static_graph": {"static_graph": True},
        "allreduce hook": {"hook": default_hooks.allreduce_hook},
    }
    for name, kwargs in variants.items():
        grads, weights = train_ddp(rank, size, **kwargs)
        for step, (g, w) in enumerate(zip(grads, want_grads, strict=True)):
            close(g, w, f"{name}: gradients of step {step}")
        close(weights, want_weights, f"{name}: final weights")
    grads, weights = train_ddp(rank, size, hook=default_hooks.fp16_compress_hook)
    close(weights, want_weights, "fp16 compression hook: final weights", tol=2e-3)
    unused_grads, unused_weights = reference(size, full, use_spare=False)
    grads, weights = train_ddp(rank, size, use_spare=False, find_unused_parameters=True)
    close(grads[0], unused_grads[0], "find_unused_parameters: gradients")
    close(weights, unused_weights, "find_unused_parameters: final weights")
    micro_grads, micro_weights = reference(size, full, micro=3)
    grads, weights = train_ddp(rank, size, micro=3)
    close(grads[-1], micro_grads[-1], "no_sync: gradients")
    close(weights, micro_weights, "no_sync: final weights")
    uneven = [STEPS + r for r in range(size)]  # rank r has r more batches than rank 0
    _, join_weights = reference(size, uneven)
    _, weights = train_ddp(rank, size, steps=uneven[rank], join=True)
    close(weights, join_weights, "Join with uneven inputs: final weights")


def fsdp(rank: int, size: int, port: int) -> None:
    """FSDP2 fully_shard on CPU trains Net to the weights of `reference`."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    if not dist.is_initialized():
        init(rank, size, port)
    mesh = init_device_mesh("cpu", (size,))
    model = Net(use_spare=True).double()
    fully_shard(model.first, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for step in range(STEPS):
        opt.zero_grad()
        x, y = batch(step, rank)
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    weights = [p.full_tensor().detach().clone() for p in model.parameters()]
    _, want = reference(size, [STEPS] * size)
    close(weights, want, "FSDP2: final weights")
    dist.destroy_process_group()


# -- a peer killed during DDP training -----------------------------------------------------------


def ddp_victim(rank: int, size: int, port: int, report_dir: str, victim: int) -> None:
    """DDP training in which rank `victim` kills itself before its third backward; the others report what they saw."""
    import json
    import signal
    import time

    from torch.nn.parallel import DistributedDataParallel as DDP

    init(rank, size, port)
    model = DDP(Net().double())
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    report: dict[str, Any] = {"rank": rank, "steps": 0}
    start = time.monotonic()
    try:
        for step in range(1000):
            if rank == victim and step == 2:
                os.kill(os.getpid(), signal.SIGKILL)
            opt.zero_grad()
            x, y = batch(step, rank)
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            report["steps"] = step + 1
    except Exception as exc:  # noqa: BLE001 - what the survivor sees is the test's subject
        report.update(error=type(exc).__name__, message=str(exc), seconds=time.monotonic() - start)
    with open(os.path.join(report_dir, f"rank{rank}.json"), "w") as handle:
        json.dump(report, handle)


def ddp_and_fsdp(rank: int, size: int, port: int) -> None:
    """`ddp`, then `fsdp`, in one start of the ranks."""
    ddp(rank, size, port)
    fsdp(rank, size, port)


# -- ranks that disagree -------------------------------------------------------------------------


def _failure(call: Callable[[], Any]) -> str | None:
    """What `call` raised, or None if it returned."""
    try:
        call()
    except Exception as exc:  # noqa: BLE001 - torch may wrap tcoll's error; its text must say what happened
        return str(exc)
    return None


def disagreements(rank: int, size: int, port: int) -> None:
    """Each call on which the ranks disagree raises on every rank; the call after it is right on every rank."""
    init(rank, size, port)
    last = rank == size - 1
    cases = {
        "op": lambda: dist.all_reduce(torch.ones(4), op=R.MAX if last else R.SUM),
        "dtype": lambda: dist.all_reduce(torch.ones(4, dtype=torch.float32 if last else torch.int32)),
        "root": lambda: dist.broadcast(torch.ones(4), src=size - 1 if last else 0),
        # a local error on rank 0 only (BAND does not apply to floats): its call still counts
        "local": lambda: dist.all_reduce(torch.ones(4), op=R.BAND if rank == 0 else R.SUM),
        # reduce goes through tcoll's dispatcher: its op, dtype and root are in the call's stamp
        "reduce op": lambda: dist.reduce(torch.ones(4), dst=0, op=R.MAX if last else R.SUM),
        "reduce dtype": lambda: dist.reduce(torch.ones(4, dtype=torch.float32 if last else torch.int32), dst=0),
        "reduce root": lambda: dist.reduce(torch.ones(4), dst=size - 1 if last else 0),
        # broadcast and all_gather move bytes, typed: a float32 / int32 mix is not read as the other
        "broadcast dtype": lambda: dist.broadcast(torch.ones(4, dtype=torch.float32 if last else torch.int32), src=0),
        "all_gather dtype": lambda: dist.all_gather(
            [torch.empty(4, dtype=torch.float32 if last else torch.int32) for _ in range(size)],
            torch.ones(4, dtype=torch.float32 if last else torch.int32)),
        "all_gather_into_tensor dtype": lambda: dist.all_gather_into_tensor(
            torch.empty(4 * size, dtype=torch.float32 if last else torch.int32),
            torch.ones(4, dtype=torch.float32 if last else torch.int32)),
        "all_gather float8": lambda: dist.all_gather(
            [torch.empty(4, dtype=torch.float8_e5m2 if last else torch.float8_e4m3fn) for _ in range(size)],
            torch.zeros(4, dtype=torch.float8_e5m2 if last else torch.float8_e4m3fn)),
        # the backend's own checks fail on rank 0 only: the others' call fails too, nothing shifts
        "local all_gather": lambda: dist.all_gather([torch.empty(4) for _ in range(size + (rank == 0))],
                                                    torch.ones(4)),
        "local reduce": lambda: dist.reduce(torch.ones(4, dtype=torch.bool), dst=0,
                                            op=R.AVG if rank == 0 else R.MAX),
        "local reduce_scatter": lambda: dist.reduce_scatter_tensor(torch.empty(2 + (rank == 0)),
                                                                   torch.ones(2 * size)),
    }
    if os.environ.get("TCOLL_TRANSPORT") == "tcp":
        # Over TCP, a rank whose part of a rooted call only sends, or that receives from a rank that agrees
        # with it, may finish the call before it hears of the disagreement (issue 27, "Still silent"):
        # the rooted cases run on shared memory, where every rank checks every other at the first step.
        cases = {name: call for name, call in cases.items()
                 if name not in ("root", "local reduce") and not name.startswith(("reduce ", "broadcast "))}
    for name, call in cases.items():
        text = _failure(call)
        if text is None:
            raise AssertionError(f"rank {rank}: the '{name}' disagreement returned without an error")
        named = ("where rank" in text or "disagree" in text or "failed this call" in text
                 or (name.startswith("local") and rank == 0))
        assert named, (rank, name, text)
        after = torch.full((3,), float(rank + 1))
        dist.all_reduce(after)
        assert torch.equal(after, torch.full((3,), size * (size + 1) / 2)), (rank, name, after)
    dist.destroy_process_group()
