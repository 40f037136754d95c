"""The reducing collectives: all_reduce, reduce, reduce_scatter, reduce_scatterv, and barrier.

Each is a Communicator method (bound in `tcoll.comm.communicator`): it checks
its arguments before anything is sent, describes the call and hands it to
the communicator's dispatcher (`tcoll.comm.dispatch`), which chooses the
algorithm and runs it. With `async_op=True` the Work is returned; otherwise
the call's result.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from ..algos.stamps import counts_digest
from ..ops import Op
from ..shm.express import NOTHING
from .calls import Call, numbered
from .checks import apart, check_peer, output, reduction_input, row_counts
from .plans import MISS, again, again_into, lean_run, lean_run_into

if TYPE_CHECKING:
    from .communicator import Communicator

__all__ = ["all_reduce", "reduce", "reduce_scatter", "reduce_scatterv", "barrier"]


def all_reduce(comm: Communicator, x: Any, op: str | Op = "sum", *, algorithm: str = "auto",
               async_op: bool = False) -> Any:
    """Reduce `x` over all ranks, in place on every rank.

    Args:
        x: a contiguous NumPy array or PyTorch CPU tensor (same shape and dtype on every rank).
        op: "sum", "prod", "min", "max", "avg", "band", "bor", "bxor", "land",
            "lor", "lxor", "maxloc", "minloc", or a tcoll.Op.
        algorithm: "auto", or one of tcoll.algorithms("all_reduce").
        async_op: return a Work instead of waiting.

    Returns:
        x (or a Work whose result() is x).

    Raises:
        TypeError: the op does not apply to the dtype; x is not a buffer.
        ValueError: x is not contiguous or is read-only; unknown algorithm.
    """
    if not async_op:  # the same buffer and arguments as a recent call: checked then (tcoll.comm.plans)
        result = again(comm, (id(x), "all_reduce", op, algorithm), x)
        if result is not MISS:
            return result
    return _all_reduce(comm, x, op, algorithm=algorithm, async_op=async_op)


@numbered("all_reduce")
def _all_reduce(comm: Communicator, x: Any, op: str | Op, *, algorithm: str, async_op: bool) -> Any:
    """all_reduce, checked (see all_reduce)."""
    flat, resolved = reduction_input(x, op, "all_reduce buffer")
    call = Call("all_reduce", (flat, resolved), flat.nbytes, op=resolved, itemsize=flat.itemsize,
                algorithm=algorithm, result=x, finish_buf=flat, dtype=flat.dtype, count=flat.size)
    key = (id(x), "all_reduce", op, algorithm)
    return comm.core.dispatch.run(call, True) if async_op else lean_run(comm.core.dispatch, key, x, call)


def reduce(comm: Communicator, x: Any, root: int = 0, op: str | Op = "sum", *, algorithm: str = "auto",
           async_op: bool = False) -> Any:
    """Reduce `x` over all ranks into `x` on `root`; x on the other ranks is left as it was.

    Args:
        x: a contiguous NumPy array or PyTorch CPU tensor.
        root: the rank that gets the result.
        op: a reduce op name or tcoll.Op (see all_reduce).
        algorithm: "auto", or one of tcoll.algorithms("reduce").
        async_op: return a Work instead of waiting.

    Returns:
        x (or a Work whose result() is x).

    Raises:
        TypeError, ValueError: as all_reduce; root out of range.
    """
    if not async_op:
        result = again(comm, (id(x), "reduce", root, op, algorithm), x)
        if result is not MISS:
            return result
    return _reduce(comm, x, root, op, algorithm=algorithm, async_op=async_op)


@numbered("reduce")
def _reduce(comm: Communicator, x: Any, root: int, op: str | Op, *, algorithm: str, async_op: bool) -> Any:
    """reduce, checked (see reduce)."""
    check_peer(root, comm.size, "root")
    arr, resolved = reduction_input(x, op, "reduce buffer", writable=comm.rank == root)
    flat = arr.reshape(-1)
    call = Call("reduce", (flat, resolved, root), flat.nbytes, op=resolved, itemsize=flat.itemsize,
                algorithm=algorithm, result=x, finish_buf=flat if comm.rank == root else None, dtype=flat.dtype,
                count=flat.size, root=root)
    key = (id(x), "reduce", root, op, algorithm)
    return comm.core.dispatch.run(call, True) if async_op else lean_run(comm.core.dispatch, key, x, call)


def reduce_scatter(comm: Communicator, x: Any, op: str | Op = "sum", out: Any = None, *, algorithm: str = "auto",
                   async_op: bool = False) -> Any:
    """Reduce `x` over all ranks and give rank r the r-th of `size` equal parts (along axis 0).

    Args:
        x: a contiguous array whose first dimension divides by size (left unchanged).
        op: a reduce op name or tcoll.Op (see all_reduce).
        out: where to write this rank's part, shape (x.shape[0] // size, *x.shape[1:]).
        algorithm: "auto", or one of tcoll.algorithms("reduce_scatter").
        async_op: return a Work instead of waiting.

    Returns:
        This rank's reduced part.

    Raises:
        ValueError: x.shape[0] does not divide by size; out has the wrong shape or dtype.
        TypeError: the op does not apply to the dtype.
    """
    if not async_op:  # the same arrays and arguments as a recent call (tcoll.comm.plans)
        result = again_into(comm, (id(x), id(out), "reduce_scatter", op, algorithm), x, out)
        if result is not MISS:
            return result
    return _reduce_scatter_checked(comm, x, op, out, algorithm=algorithm, async_op=async_op)


@numbered("reduce_scatter")
def _reduce_scatter_checked(comm: Communicator, x: Any, op: str | Op, out: Any, *, algorithm: str,
                            async_op: bool) -> Any:
    """reduce_scatter, checked (see reduce_scatter)."""
    arr, resolved = reduction_input(x, op, "reduce_scatter buffer", writable=False)
    if arr.ndim == 0 or arr.shape[0] % comm.size:
        raise ValueError(f"reduce_scatter splits x along axis 0 into {comm.size} equal parts; "
                         f"x has shape {arr.shape} (use reduce_scatterv for uneven parts)")
    part_shape = (arr.shape[0] // comm.size, *arr.shape[1:])
    user_out, out_flat = output(x, arr, out, part_shape, "reduce_scatter")
    counts = [out_flat.size] * comm.size
    key = (id(x), id(out), "reduce_scatter", op, algorithm)
    return _reduce_scatter(comm, "reduce_scatter", apart(arr.reshape(-1), out_flat), out_flat, user_out, counts,
                           resolved, algorithm, async_op, (x, out, key))


@numbered("reduce_scatterv")
def reduce_scatterv(comm: Communicator, x: Any, counts: Sequence[int], op: str | Op = "sum", out: Any = None, *,
                    algorithm: str = "auto", async_op: bool = False) -> Any:
    """Reduce `x` over all ranks and give rank r rows [sum(counts[:r]), sum(counts[:r+1])) of the result.

    Args:
        x: a contiguous array of shape (sum(counts), ...), same shape and dtype on every rank (left unchanged).
        counts: the number of rows of each rank's part, the same list on every rank.
        op: a reduce op name or tcoll.Op (see all_reduce).
        out: where to write this rank's part, shape (counts[rank], *x.shape[1:]); allocated if None.
        algorithm: "auto", or one of tcoll.algorithms("reduce_scatter") (uneven-capable if counts differ).
        async_op: return a Work instead of waiting.

    Returns:
        This rank's reduced part.

    Raises:
        ValueError: counts is not `size` non-negative integers summing to x.shape[0]; out has
            the wrong shape or dtype; the algorithm needs equal counts.
        TypeError: the op does not apply to the dtype.
        MismatchError: (on every rank) the ranks' counts lists differ.
    """
    arr, resolved = reduction_input(x, op, "reduce_scatterv buffer", writable=False)
    if arr.ndim == 0:
        raise ValueError("reduce_scatterv splits x along axis 0; x is 0-d")
    rows = row_counts(counts, comm.size, arr.shape[0])
    inner = math.prod(arr.shape[1:])
    user_out, out_flat = output(x, arr, out, (rows[comm.rank], *arr.shape[1:]), "reduce_scatterv")
    return _reduce_scatter(comm, "reduce_scatterv", apart(arr.reshape(-1), out_flat), out_flat, user_out,
                           [n * inner for n in rows], resolved, algorithm, async_op)


def _reduce_scatter(comm: Communicator, label: str, send: np.ndarray, out_flat: np.ndarray, user_out: Any,
                    counts: list[int], op: Op, algorithm: str, async_op: bool,
                    lean: tuple[Any, Any, Any] | None = None) -> Any:
    """Dispatch a checked reduce_scatter(v); `lean`: (x, out, key) of a blocking call the caller gave `out`
    for, remembered for the lean path (tcoll.comm.plans)."""
    # A reduce_scatterv's stamp carries a digest of its counts where others carry a root: ranks whose lists
    # differ would otherwise cut the same vector differently and each get a wrong part, silently.
    root = counts_digest(counts) if label == "reduce_scatterv" else 0
    call = Call("reduce_scatter", (send, out_flat, counts, op), send.nbytes, label=label, op=op,
                itemsize=send.itemsize, uneven=len(set(counts)) > 1, algorithm=algorithm, result=user_out,
                finish_buf=out_flat, dtype=send.dtype, count=send.size, root=root)
    if async_op or lean is None:
        return comm.core.dispatch.run(call, async_op)
    x, out, key = lean
    return lean_run_into(comm.core.dispatch, key, x, call, out)


@numbered("barrier")
def barrier(comm: Communicator, *, algorithm: str = "auto", async_op: bool = False) -> Any:
    """Return once every rank has called barrier().

    Args:
        algorithm: "auto", or one of tcoll.algorithms("barrier").
        async_op: return a Work instead of waiting.
    """
    dispatcher = comm.core.dispatch
    if async_op or dispatcher.capturing:
        return dispatcher.run(Call("barrier", (), 0, algorithm=algorithm), async_op)
    # Remembered (and run whole in C, tcoll.shm.express) as a call on a buffer of no bytes: the token.
    if again(comm, ("barrier", algorithm), NOTHING) is MISS:
        lean_run(dispatcher, ("barrier", algorithm), NOTHING, Call("barrier", (), 0, algorithm=algorithm,
                                                                   result=NOTHING))
    return None
