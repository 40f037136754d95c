"""The torch.distributed backend "tcoll": a `dist.ProcessGroup` subclass over a tcoll Communicator.

This module and `reduce_ops` (torch's ReduceOp, read as tcoll's ops) are
the only ones that touch torch internals; the data movement collectives'
tensor plumbing is in `movement`. torch's Python
`Backend` cannot be subclassed, so the backend is a ProcessGroup subclass,
which `init_process_group` / `new_group` use as the group itself. torch
reaches the Python methods in two ways: the Python API calls them by name
(`group.allreduce([t], opts)`), and C++ (DDP's reducer, functional
collectives, FSDP2) calls the trampolined ones: allreduce, allreduce_coalesced,
broadcast, allgather, all_gather_single_coalesced, reduce_scatter,
reduce_scatter_single_coalesced, all_to_all_single, barrier, send, recv,
abort, getBackendName, getRank, getSize and the group name and description
accessors. Every method of both lists is here, in the old and new spellings.

How a call runs. Collectives run to completion inside the call, as blocking
tcoll calls (the fastest tcoll algorithms, the shared-memory "direct" ones,
serve only blocking calls), and return a `Work` that is already complete
(None to torch's own blocking `dist.all_reduce`, which takes that as done).
tcoll has no progress thread (the waiter moves the data), and C++ callers
(DDP) wait on the Work's Future, in C++, right after the call, so starting a
collective asynchronously would buy no overlap: see docs/torch.md for the
measurements. TCOLL_TORCH_ASYNC=1 makes calls with async_op=True start
asynchronously instead (wait(), or get_future(), completes them).
Point-to-point calls are always asynchronous: a blocking send could not pair
with a later receive on the same thread (the seed's ring all-reduce does
isend, then recv).

Failures. A failed operation raises a Python exception from the call, from
`wait()` or from `get_future()`, all of which reach the Python caller even
through DDP's C++ hooks. A Future is never completed with an exception or
with None: in torch 2.13 either crashes the process (SIGSEGV) inside DDP's
C++ allreduce hook.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from ..comm.communicator import Communicator
from ..comm.pairs import ANY_SOURCE
from ..errors import TcollError
from ..errors import TimeoutError as TcollTimeout
from . import BACKEND_NAME, devices, movement, worlds
from .plans import AllReducePlans
from .reduce_ops import HASH_IS_VALUE, SIMPLE_OPS, reduction
from .sparse import all_reduce_sparse
from .tensors import (NATIVE, Contiguous, check_count, finisher, kept, np_bytes, np_view, reduce_source,
                      reduce_target)
from .work import (Finish, Held, TcollWork, async_requested, chain, completed, counted, detached, drop_held, each,
                   held_calls, run_held, seconds, timed_out)

__all__ = ["ProcessGroupTcoll", "BACKEND_NAME"]

_STRIDED = torch.strided
_SIMPLE_DTYPES = NATIVE
# dist.all_reduce(async_op=False) takes None for a call done inside, where a Work costs a tenth of a small call.
_DIST_ALL_REDUCE = inspect.unwrap(dist.all_reduce).__code__


class ProcessGroupTcoll(dist.ProcessGroup):
    """A torch process group whose collectives and point-to-point calls run on a tcoll Communicator.

    Made by torch through the registered backend ("tcoll"), not directly.

    Args:
        comm: the communicator (a world for the default group, a sub-communicator for a subgroup).
    """

    def __init__(self, comm: Communicator) -> None:
        super().__init__(comm.rank, comm.size)
        self.comm = comm
        self._group_name = ""
        self._group_desc = ""
        self._sequence = 0
        self._plans = AllReducePlans(comm)  # a small tensor's all_reduce, bound once (see .plans)
        self._routes: dict[str, Any] = {}  # device type -> the c10d Backend serving it (tcoll.torch.devices)
        self._shrinks = 0  # shrink_group calls on this group (they name the new groups)
        self._successor: ProcessGroupTcoll | None = None  # the group shrink_group made of this one's survivors

    # -- identity -------------------------------------------------------------------

    def getBackendName(self) -> str:  # noqa: N802 - torch's name
        return BACKEND_NAME

    def getRank(self) -> int:  # noqa: N802
        return self.comm.rank

    def getSize(self) -> int:  # noqa: N802
        return self.comm.size

    def _set_group_name(self, name: str) -> None:
        self._group_name = name

    def setGroupName(self, name: str) -> None:  # noqa: N802
        self._group_name = name

    def getGroupName(self) -> str:  # noqa: N802
        return self._group_name

    @property
    def group_name(self) -> str:
        if not self._group_name:
            raise RuntimeError("ProcessGroup name not set")
        return self._group_name

    def _set_group_desc(self, desc: str) -> None:
        self._group_desc = desc

    def setGroupDesc(self, desc: str) -> None:  # noqa: N802
        self._group_desc = desc

    def getGroupDesc(self) -> str:  # noqa: N802
        return self._group_desc

    @property
    def group_desc(self) -> str:
        return self._group_desc or "undefined"

    def _get_sequence_number_for_group(self) -> int:
        """How many collectives this group has run (the same on every rank in a correct program)."""
        return self._sequence

    def __repr__(self) -> str:
        return f"<ProcessGroupTcoll {self._group_name or '?'}: rank {self.comm.rank} of {self.comm.size}>"

    # -- life cycle -----------------------------------------------------------------

    def shutdown(self, abort: bool = False) -> None:
        """Release the communicator (the world's channels too, for the group that owns them).

        Calls still held (work.Held) run first, unless `abort`: then this group's fail instead. A group
        that shrink_group replaced keeps its communicator while the group that replaced it lives (that
        one's shutdown closes both).
        """
        comm = self.comm
        if held_calls and not comm.closed:
            if abort:
                drop_held(comm, TcollError(f"process group {self._group_name or ''} ({BACKEND_NAME}) was aborted"))
            run_held()  # held calls of every group, this one's among them, run before it goes
        worlds.forget_world(comm)
        if comm.closed:
            return
        successor = self._successor
        if successor is not None and not successor.comm.closed:
            return  # the shrunk group uses this one's channels: closing it closes this communicator too
        comm.close(linger=not abort)  # a sub-communicator's close only marks it closed: the world keeps its channels

    def abort(self) -> None:
        """Stop now: pending operations fail (tcoll's close)."""
        self.shutdown(abort=True)

    # -- running calls ---------------------------------------------------------------

    def _issue(self, outputs: list[torch.Tensor], start: Callable[[bool], list[Any]], async_op: bool | None,
               finish: Finish | None = None) -> TcollWork:
        """Run `start(async_op)`: blocking calls return [] once done; async ones the tcoll Works they started;
        with async_op None, the call is held until its Work is waited for (`Held`)."""
        if self.comm.closed:
            raise self._shut_down()
        if held_calls:
            run_held()
        self._sequence += 1
        if async_op is None:
            return TcollWork(self, outputs, [Held(self.comm, start)], finish)
        try:
            pending = start(async_op)
        except TcollTimeout as exc:
            raise timed_out(exc) from exc
        except TcollError as exc:
            raise detached(exc) from exc.__cause__
        return TcollWork(self, outputs, pending if async_op else (), finish)

    @counted("split")
    def split_group(self, ranks: Sequence[int], timeout: Any = None, opts: Any = None, group_name: str | None = None,
                    group_desc: str | None = None, device_types: Any = None) -> ProcessGroupTcoll | None:
        """torch's ProcessGroup.split_group: a new group of `ranks` (ranks of this group); collective here.

        Every rank of this group calls it, each with the (sorted) ranks of its
        own split, or with a list it is not in to join none (then it returns
        None). The new group is a tcoll sub-communicator (`Communicator.split`).
        `tcoll.torch.split_group` registers it with torch.distributed.
        """
        members = sorted(int(r) for r in ranks)
        mine = self.comm.rank in members
        sub = self.comm.split(members[0] if mine else None, members.index(self.comm.rank) if mine else None)
        if sub is None:
            return None
        sub.timeout = seconds(timeout) or self.comm.timeout
        pg = ProcessGroupTcoll(sub)
        pg._set_group_name(group_name or "")
        pg._set_group_desc(group_desc or "")
        return pg

    # -- reductions -------------------------------------------------------------------

    def _in_place(self, t: torch.Tensor, reduce_op: Any) -> tuple[torch.Tensor, str, Finish]:
        """For a reduction in place on `t`: (the buffer tcoll reduces, the op name, what writes `t`)."""
        name, factor, int_avg, wide = reduction(reduce_op, t.dtype)
        src = reduce_source(t, factor, wide)
        return src, name, finisher(src, t, int_avg, self.comm.size)

    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> TcollWork:
        if self._routes and devices.device_of(tensors) in self._routes:  # "cpu:tcoll,cuda:nccl"'s CUDA half
            backend = self._routes[devices.device_of(tensors)]
            return backend.allreduce(tensors) if opts is None else backend.allreduce(tensors, opts)
        opts = opts if opts is not None else dist.AllreduceOptions()
        if len(tensors) == 1:  # the common case, kept short: it is DDP's and the latency benchmark's
            t = tensors[0]
            name = SIMPLE_OPS.get(hash(opts.reduceOp) if HASH_IS_VALUE else opts.reduceOp.op.value)
            if name is not None and t.layout is _STRIDED and t.dtype in _SIMPLE_DTYPES and t.is_contiguous():
                if not opts.asyncOp and not held_calls:  # dist.all_reduce(t): run it now
                    self._sequence += 1
                    self._all_reduce_now(t, name)
                    if sys._getframe(1).f_code is _DIST_ALL_REDUCE:
                        return None  # torch's blocking all_reduce takes None as "done" and drops any Work
                    return completed(self, tensors)
                mode = async_requested(opts)
                if mode is None:
                    return self._issue(tensors, lambda _: self._all_reduce_now(t, name), None)
                if mode and not self.comm.closed:
                    if held_calls:
                        run_held()
                    self._sequence += 1
                    return TcollWork(self, tensors, [self.comm.all_reduce(np_view(t), name, async_op=True)])
                return self._issue(tensors, lambda _: self._all_reduce_now(t, name), False)
        return self._allreduce_any(tensors, opts)

    @counted("all_reduce")
    def _allreduce_any(self, tensors: list[torch.Tensor], opts: Any) -> TcollWork:
        """allreduce of a list, a sparse tensor, or an op or dtype that takes an extra step."""
        if any(t.is_sparse for t in tensors):  # gloo's way: gather every rank's entries, coalesce
            def start_sparse(_: bool) -> list[Any]:
                for t in tensors:
                    all_reduce_sparse(self.comm, t, reduction(opts.reduceOp, t.dtype)[0])
                return []

            return self._issue(list(tensors), start_sparse, async_requested(opts) and None)
        prepared = [self._in_place(t, opts.reduceOp) for t in tensors]

        def start(async_op: bool) -> list[Any]:
            return [self.comm.all_reduce(np_view(src), name, async_op=async_op) for src, name, _ in prepared]

        return self._issue(list(tensors), start, async_requested(opts), each(p[2] for p in prepared))

    @counted("all_reduce")
    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> TcollWork:
        """All-reduce several tensors as one flat buffer per dtype (one tcoll call each)."""
        opts = opts if opts is not None else dist.AllreduceCoalescedOptions()
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for t in tensors:
            by_dtype.setdefault(t.dtype, []).append(t)
        groups = []
        for members in by_dtype.values():
            flat = torch.cat([m.detach().reshape(-1) for m in members]) if members else torch.empty(0)
            src, name, back = self._in_place(flat, opts.reduceOp)
            groups.append((members, flat, src, name, back))

        def start(async_op: bool) -> list[Any]:
            return [self.comm.all_reduce(np_view(src), name, async_op=async_op) for _, _, src, name, _ in groups]

        def finish() -> None:
            with torch.no_grad():
                for members, flat, _, _, back in groups:
                    back()
                    at = 0
                    for m in members:
                        m.copy_(flat[at:at + m.numel()].view(m.shape))
                        at += m.numel()

        return self._issue(list(tensors), start, async_requested(opts), finish)

    @counted("reduce")
    def reduce(self, tensors: list[torch.Tensor], opts: Any = None) -> TcollWork:
        """tcoll's reduce into the root's tensor; the others' are left as they were (torch: undefined)."""
        opts = opts if opts is not None else dist.ReduceOptions()
        root, prepared = int(opts.rootRank), []
        for t in tensors:
            name, factor, int_avg, wide = reduction(opts.reduceOp, t.dtype)
            src = reduce_source(t, factor, wide)
            prepared.append((src, name, finisher(src, t, int_avg, self.comm.size)))

        def start(async_op: bool) -> list[Any]:  # (views kept: a repeated call on the same tensor is the same call)
            return [self.comm.reduce(kept(src, ("view",), np_view), root, name, async_op=async_op)
                    for src, name, _ in prepared]

        finish = each(back for _, _, back in prepared) if self.comm.rank == root else None
        return self._issue(list(tensors), start, async_requested(opts), finish)

    @counted("reduce_scatter")
    def reduce_scatter(self, output_tensors: list[torch.Tensor], input_tensors: list[list[torch.Tensor]],
                       opts: Any = None) -> TcollWork:
        """Reduce rank r's input_tensors[0][j] over ranks into rank j's output (sizes may differ by j)."""
        opts = opts if opts is not None else dist.ReduceScatterOptions()
        output, inputs = output_tensors[0], input_tensors[0]
        check_count(inputs, self.comm.size, "reduce_scatter input list")
        flat = torch.cat([t.detach().reshape(-1) for t in inputs])
        counts = [t.numel() for t in inputs]
        return self._reduce_scatter_flat(output, flat, counts, opts)

    def _reduce_scatter_flat(self, output: torch.Tensor, flat: torch.Tensor, counts: list[int],
                             opts: Any) -> TcollWork:
        """Reduce-scatter the flat `flat` (part j: counts[j] elements) into `output`."""
        name, factor, int_avg, wide = reduction(opts.reduceOp, flat.dtype)
        src = reduce_source(flat, factor, wide)
        dst = reduce_target(output, wide)
        back = finisher(dst, output, int_avg, self.comm.size)
        size, part = self.comm.size, counts[self.comm.rank]
        if dst.numel() != part:
            raise ValueError(f"reduce_scatter: this rank's output holds {output.numel()} elements, "
                             f"its part of the input {part}")
        even = len(set(counts)) == 1

        def start(async_op: bool) -> list[Any]:
            if even:  # (views kept: a repeated call on the same tensors is the same call to tcoll)
                x = kept(src, ("rows", size), lambda t: np_view(t.reshape(size, part)))
                out = kept(dst, ("rows", 1), lambda t: np_view(t.reshape(1, part)))
                return [self.comm.reduce_scatter(x, name, out=out, async_op=async_op)]
            return [self.comm.reduce_scatterv(np_view(src), counts, name, out=np_view(dst.reshape(-1)),
                                              async_op=async_op)]

        return self._issue([output], start, async_requested(opts), back)

    @counted("reduce_scatter")
    def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> TcollWork:
        opts = opts if opts is not None else dist.ReduceScatterOptions()
        size = self.comm.size
        if input.numel() != output.numel() * size:
            raise ValueError(f"reduce_scatter_tensor: input has {input.numel()} elements, "
                             f"output {output.numel()}; the input must hold {size} outputs")
        flat = input.detach().reshape(-1)
        return self._reduce_scatter_flat(output, flat, [output.numel()] * size, opts)

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter_single_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                                        opts: Any = None) -> TcollWork:
        return chain(self, [self.reduce_scatter_single(o, i, opts) for o, i in zip(outputs, inputs, strict=True)],
                      list(outputs))

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    # -- data movement (the tensor plumbing of each: tcoll.torch.movement) ------------------------

    @counted("broadcast")
    def broadcast(self, tensors: list[torch.Tensor], opts: Any = None) -> TcollWork:
        opts = opts if opts is not None else dist.BroadcastOptions()
        outputs, start, finish = movement.broadcast(self.comm, tensors, int(opts.rootRank))
        return self._issue(outputs, start, async_requested(opts), finish)

    @counted("all_gather")
    def allgather(self, output_tensors: list[list[torch.Tensor]], input_tensors: list[torch.Tensor],
                  opts: Any = None) -> TcollWork:
        """Rank r's input lands in output_tensors[0][r] of every rank (sizes may differ by rank)."""
        opts = opts if opts is not None else dist.AllgatherOptions()
        outputs, start, finish = movement.all_gather(self.comm, output_tensors[0], input_tensors[0])
        return self._issue(outputs, start, async_requested(opts), finish)

    @counted("all_gather")
    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> TcollWork:
        opts = opts if opts is not None else dist.AllgatherOptions()
        outputs, start, finish = movement.all_gather_into(self.comm, output, input)
        return self._issue(outputs, start, async_requested(opts), finish)

    _allgather_base = all_gather_single

    def all_gather_single_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                                    opts: Any = None) -> TcollWork:
        return chain(self, [self.all_gather_single(o, i, opts) for o, i in zip(outputs, inputs, strict=True)],
                      list(outputs))

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    @counted("all_gather")
    def allgather_coalesced(self, output_lists: list[list[torch.Tensor]], inputs: list[torch.Tensor],
                            opts: Any = None) -> TcollWork:
        """Rank r's inputs[i] lands in output_lists[r][i] of every rank (torch's layout: [rank][i])."""
        check_count(output_lists, self.comm.size, "all_gather_coalesced output list")
        for r, outs in enumerate(output_lists):
            if len(outs) != len(inputs):
                raise ValueError(f"all_gather_coalesced: output list {r} holds {len(outs)} tensors, "
                                 f"not one per input ({len(inputs)})")
        works = [self.allgather([[outs[i] for outs in output_lists]], [x], opts) for i, x in enumerate(inputs)]
        return chain(self, works, [t for outs in output_lists for t in outs])

    @counted("gather")
    def gather(self, output_tensors: list[list[torch.Tensor]], input_tensors: list[torch.Tensor],
               opts: Any = None) -> TcollWork:
        opts = opts if opts is not None else dist.GatherOptions()
        outputs, start, finish = movement.gather(self.comm, output_tensors[0] if output_tensors else [],
                                                 input_tensors[0], int(opts.rootRank))
        return self._issue(outputs, start, async_requested(opts), finish)

    @counted("scatter")
    def scatter(self, output_tensors: list[torch.Tensor], input_tensors: list[list[torch.Tensor]],
                opts: Any = None) -> TcollWork:
        opts = opts if opts is not None else dist.ScatterOptions()
        outputs, start, finish = movement.scatter(self.comm, output_tensors[0], input_tensors, int(opts.rootRank))
        return self._issue(outputs, start, async_requested(opts), finish)

    @counted("all_to_all")
    def all_to_all_single(self, output: torch.Tensor, input: torch.Tensor, output_split_sizes: list[int],
                          input_split_sizes: list[int], opts: Any = None) -> TcollWork:
        """Rows input[split j] go to rank j; rows from rank i land in output[split i] (even splits if empty)."""
        opts = opts if opts is not None else dist.AllToAllOptions()
        outputs, start, finish = movement.all_to_all_rows(self.comm, output, input, output_split_sizes,
                                                          input_split_sizes)
        return self._issue(outputs, start, async_requested(opts), finish)

    alltoall_base = all_to_all_single

    @counted("all_to_all")
    def alltoall(self, output_tensors: list[torch.Tensor], input_tensors: list[torch.Tensor],
                 opts: Any = None) -> TcollWork:
        opts = opts if opts is not None else dist.AllToAllOptions()
        outputs, start, finish = movement.all_to_all(self.comm, output_tensors, input_tensors)
        return self._issue(outputs, start, async_requested(opts), finish)

    @counted("barrier")
    def barrier(self, opts: Any = None) -> TcollWork:
        opts = opts if opts is not None else dist.BarrierOptions()

        def start(async_op: bool) -> list[Any]:
            return [self.comm.barrier(async_op=async_op)]

        return self._issue([], start, async_requested(opts))

    # -- point to point -----------------------------------------------------------------

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int = 0) -> TcollWork:
        self._ready()
        held = Contiguous(tensors[0])
        work = self.comm.isend(np_bytes(held.work), int(dst), int(tag))
        return self._p2p([held.work], [work], None)

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int = 0) -> TcollWork:
        self._ready()
        out = Contiguous(tensors[0], copy_in=False)
        work = self.comm.irecv(np_bytes(out.work), int(src), int(tag))
        return self._p2p([tensors[0]], [work], out.back, source=int(src))

    def recv_anysource(self, tensors: list[torch.Tensor], tag: int = 0) -> TcollWork:
        """Receive from whichever rank's message (with this tag) comes first: a tcoll ANY_SOURCE receive."""
        self._ready()
        out = Contiguous(tensors[0], copy_in=False)
        work = self.comm.irecv(np_bytes(out.work), ANY_SOURCE, int(tag))
        result = self._p2p([tensors[0]], [work], None)

        def finish() -> None:
            result._source = work.source
            out.back()

        result._finish = finish
        return result

    def _p2p(self, outputs: list[torch.Tensor], pending: list[Any], finish: Finish | None,
             source: int = -1) -> TcollWork:
        return TcollWork(self, outputs, pending, finish, source)

    def _ready(self) -> None:
        """Before a point-to-point call: run the collectives still held, which were called before it."""
        if held_calls:
            run_held()

    # -- helpers ----------------------------------------------------------------------

    def _all_reduce_now(self, t: torch.Tensor, name: str) -> None:
        """A blocking tcoll all_reduce of `t`'s memory (a kept plan if `t` is small: tcoll.torch.plans).

        Raises:
            TimeoutError: worded as torch's backends word it (`timed_out`).
            TcollError: the group is shut down, or the call failed.
        """
        try:
            self._plans.run(t, name)
        except TcollTimeout as exc:
            raise timed_out(exc) from exc
        except TcollError as exc:
            if self.comm.closed:
                raise self._shut_down() from exc
            raise detached(exc) from exc.__cause__

    def _shut_down(self) -> TcollError:
        return TcollError(f"process group {self._group_name or ''} ({BACKEND_NAME}) is shut down")


devices.install(ProcessGroupTcoll)
