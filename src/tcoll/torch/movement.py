"""The tensor plumbing of the torch backend's data movement: broadcast, all_gather, gather, scatter, all_to_all.

Each function takes the group's communicator and torch's arguments, checks
them (raising before anything is sent), and returns what
`ProcessGroupTcoll._issue` runs: the output tensors, `start(async_op)` (the
tcoll calls; a list of their Works when started asynchronously) and the
finisher that writes the outputs once the calls are done (None: they land in
place). Which buffers tcoll sees (typed views where the dtype should be in the
call's stamp, byte views where ranks may legitimately differ) is decided here;
the ProcessGroup surface torch calls is in tcoll.torch.process_group.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..comm.communicator import Communicator
from .tensors import Contiguous, as_bytes, check_count, fill, kept, np_bytes, pieces, row_bytes, typed
from .work import Finish, each, result_of

__all__ = ["Issued", "broadcast", "all_gather", "all_gather_into", "gather", "scatter", "all_to_all_rows",
           "all_to_all"]

Issued = tuple[list[torch.Tensor], Callable[[bool], list[Any]], Finish | None]
_U8 = torch.uint8


def broadcast(comm: Communicator, tensors: list[torch.Tensor], root: int) -> Issued:
    """Root's tensors into every rank's (typed: ranks whose dtypes differ get a MismatchError)."""
    held = [Contiguous(t, copy_in=comm.rank == root) for t in tensors]

    def start(async_op: bool) -> list[Any]:  # (views kept: a repeated call on the same tensor is the same call)
        return [comm.broadcast(kept(h.work, ("typed",), typed), root, async_op=async_op) for h in held]

    return list(tensors), start, each(h.back for h in held)


def all_gather(comm: Communicator, outputs: list[torch.Tensor], input: torch.Tensor) -> Issued:
    """Rank r's input into outputs[r] of every rank: one all_gather if the sizes agree, else all_gatherv.

    Raises:
        ValueError: outputs does not hold one tensor per rank.
    """
    x = Contiguous(input).work
    check_count(outputs, comm.size, "all_gather output list")
    # Its dtype is in the call's stamp: ranks whose dtypes differ get a MismatchError. The view is kept, so
    # a repeated call on the same tensor is the same call to tcoll (which still gives a new array each time).
    send = kept(x, ("typed",), typed)
    sizes = [o.numel() * o.element_size() for o in outputs]
    equal = len(set(sizes)) == 1 and sizes[0] == send.nbytes
    arrived: list[Any] = []

    def start(async_op: bool) -> list[Any]:
        work = comm.all_gather(send, async_op=async_op) if equal else comm.all_gatherv(send, async_op=async_op)
        arrived.append(work)
        return [work]

    return list(outputs), start, lambda: fill(outputs, result_of(arrived[0]))


def all_gather_into(comm: Communicator, output: torch.Tensor, input: torch.Tensor) -> Issued:
    """Every rank's input, in rank order, into one output tensor (all_gather_into_tensor).

    Raises:
        ValueError: the output does not hold size inputs.
    """
    x, out = Contiguous(input).work, Contiguous(output, copy_in=False)
    if out.work.numel() * out.work.element_size() != x.numel() * x.element_size() * comm.size:
        raise ValueError(f"all_gather_into_tensor: output has {output.numel()} elements, input "
                         f"{input.numel()}; the output must hold {comm.size} inputs")
    size = comm.size  # (views kept: a repeated call on the same tensors is the same call to tcoll)
    if out.work.dtype == x.dtype:  # typed: the dtype is in the call's stamp (see tensors.typed)
        send = kept(x, ("typed",), typed)
        target = kept(out.work, ("typed", size), lambda t: typed(t).reshape(size, -1))
    else:
        send = kept(x, ("bytes",), np_bytes)
        target = kept(out.work, ("bytes", size), lambda t: np_bytes(t).reshape(size, -1))

    def start(async_op: bool) -> list[Any]:
        return [comm.all_gather(send, out=target, async_op=async_op)]

    return [output], start, out.back


def gather(comm: Communicator, outputs: list[torch.Tensor], input: torch.Tensor, root: int) -> Issued:
    """Every rank's input into root's outputs (as bytes).

    Raises:
        ValueError: on the root, outputs does not hold one tensor per rank.
    """
    send = as_bytes(Contiguous(input).work)
    gathered = None
    if comm.rank == root:
        check_count(outputs, comm.size, "gather list")
        gathered = torch.empty((comm.size, send.numel()), dtype=_U8)

    def start(async_op: bool) -> list[Any]:
        return [comm.gather(send.numpy(), root, out=None if gathered is None else gathered.numpy(),
                            async_op=async_op)]

    finish = (lambda: fill(outputs, gathered)) if gathered is not None else None
    return list(outputs), start, finish


def scatter(comm: Communicator, output: torch.Tensor, input_tensors: list[list[torch.Tensor]], root: int) -> Issued:
    """Root's input_tensors[0][r] into rank r's output (as bytes).

    Raises:
        ValueError: on the root, the input list does not hold one tensor per rank.
    """
    out = Contiguous(output, copy_in=False)
    chunks = None
    if comm.rank == root:
        check_count(input_tensors[0], comm.size, "scatter list")
        chunks = [np_bytes(Contiguous(t).work) for t in input_tensors[0]]

    def start(async_op: bool) -> list[Any]:
        return [comm.scatter(chunks, root, out=np_bytes(out.work), async_op=async_op)]

    return [output], start, out.back


def all_to_all_rows(comm: Communicator, output: torch.Tensor, input: torch.Tensor, output_split_sizes: list[int],
                    input_split_sizes: list[int]) -> Issued:
    """Rows input[split j] to rank j, rows from rank i into output[split i]: all_to_all if even, else all_to_allv.

    Raises:
        ValueError: split sizes that are not one row count per rank adding up to the tensor's rows.
    """
    size = comm.size
    x, out = Contiguous(input).work, Contiguous(output, copy_in=False)
    send, recv = as_bytes(x), as_bytes(out.work)
    in_rows = row_bytes(x, input_split_sizes, size, "input")
    out_rows = row_bytes(out.work, output_split_sizes, size, "output")
    if len(set(in_rows)) == 1 and len(set(out_rows)) == 1 and in_rows[0] == out_rows[0]:
        blocks = (size, in_rows[0])  # (views kept: a repeated call on the same tensors is the same call)
        send_view = kept(x, ("rows", *blocks), lambda t: as_bytes(t).view(blocks).numpy())
        recv_view = kept(out.work, ("rows", *blocks), lambda t: as_bytes(t).view(blocks).numpy())

        def start(async_op: bool) -> list[Any]:
            return [comm.all_to_all(send_view, out=recv_view, async_op=async_op)]

        return [output], start, out.back
    arrived: list[Any] = []
    chunks = [c.numpy() for c in pieces(send, in_rows)]

    def start_v(async_op: bool) -> list[Any]:
        work = comm.all_to_allv(chunks, async_op=async_op)
        arrived.append(work)
        return [work]

    def finish() -> None:
        fill(pieces(recv, out_rows), result_of(arrived[0]))
        out.back()

    return [output], start_v, finish


def all_to_all(comm: Communicator, outputs: list[torch.Tensor], inputs: list[torch.Tensor]) -> Issued:
    """inputs[j] to rank j, rank i's into outputs[i] (any sizes: all_to_allv of bytes).

    Raises:
        ValueError: either list does not hold one tensor per rank.
    """
    check_count(outputs, comm.size, "all_to_all output list")
    check_count(inputs, comm.size, "all_to_all input list")
    chunks = [np_bytes(Contiguous(t).work) for t in inputs]
    arrived: list[Any] = []

    def start(async_op: bool) -> list[Any]:
        work = comm.all_to_allv(chunks, async_op=async_op)
        arrived.append(work)
        return [work]

    return list(outputs), start, lambda: fill(outputs, result_of(arrived[0]))
