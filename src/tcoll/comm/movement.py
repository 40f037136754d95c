"""The collectives that move data without reducing it: broadcast, all_gather, gather, scatter, all_to_all.

Each is a Communicator method: it checks its arguments, puts this rank's own
block where it belongs, and hands the call to the dispatcher. The other ranks
of a scatter learn what they receive from root: on one host in the call's
first step (tcoll.shm.described), elsewhere from a program of two steps (see
`tcoll.comm.dispatch`), root's description of the chunks, then the chunks.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from ..buffers import as_array
from ..errors import MismatchError
from . import describe
from .calls import Call, Program, numbered
from .checks import apart, check_peer, output, stacked_chunks
from .plans import MISS, again, again_into, lean_run, lean_run_into

if TYPE_CHECKING:
    from .communicator import Communicator

__all__ = ["broadcast", "all_gather", "gather", "scatter", "all_to_all"]


def broadcast(comm: Communicator, x: Any, root: int = 0, *, algorithm: str = "auto", async_op: bool = False) -> Any:
    """Copy `x` of `root` into `x` of every rank.

    Args:
        x: a contiguous NumPy array or PyTorch CPU tensor (writable except on root).
        root: the rank whose data is sent.
        algorithm: "auto", or one of tcoll.algorithms("broadcast").
        async_op: return a Work instead of waiting.

    Returns:
        x (or a Work whose result() is x).

    Raises:
        ValueError: root out of range; x not contiguous, or read-only off the root.
        TypeError: x is not a buffer.
    """
    if not async_op:  # the same buffer and arguments as a recent call: checked then (tcoll.comm.plans)
        result = again(comm, (id(x), "broadcast", root, algorithm), x)
        if result is not MISS:
            return result
    return _broadcast(comm, x, root, algorithm=algorithm, async_op=async_op)


@numbered("broadcast")
def _broadcast(comm: Communicator, x: Any, root: int, *, algorithm: str, async_op: bool) -> Any:
    """broadcast, checked (see broadcast)."""
    key = (id(x), "broadcast", root, algorithm)
    dispatcher = comm.core.dispatch
    check_peer(root, comm.size, "root")
    flat = as_array(x, writable=comm.rank != root, what="broadcast buffer").reshape(-1)
    call = Call("broadcast", (flat, root), flat.nbytes, algorithm=algorithm, result=x, dtype=flat.dtype,
                count=flat.size, root=root)
    return dispatcher.run(call, True) if async_op else lean_run(dispatcher, key, x, call)


def all_gather(comm: Communicator, x: Any, out: Any = None, *, algorithm: str = "auto",
               async_op: bool = False) -> Any:
    """Gather every rank's `x` on every rank.

    Args:
        x: a contiguous NumPy array or PyTorch CPU tensor (same shape and dtype on every rank).
        out: where to write the result, shape (size, *x.shape); allocated if None.
        algorithm: "auto", or one of tcoll.algorithms("all_gather").
        async_op: return a Work instead of waiting.

    Returns:
        The array of shape (size, *x.shape) whose row r is rank r's x.

    Raises:
        ValueError: out has the wrong shape or dtype; x not contiguous.
        TypeError: x or out is not a buffer.
    """
    if not async_op:  # the same arrays and arguments as a recent call (tcoll.comm.plans)
        result = again_into(comm, (id(x), id(out), "all_gather", algorithm), x, out)
        if result is not MISS:
            return result
    return _all_gather(comm, x, out, algorithm=algorithm, async_op=async_op)


@numbered("all_gather")
def _all_gather(comm: Communicator, x: Any, out: Any, *, algorithm: str, async_op: bool) -> Any:
    """all_gather, checked (see all_gather)."""
    arr = as_array(x, writable=False, what="all_gather input")
    user_out, out_flat = output(x, arr, out, (comm.size, *arr.shape), "all_gather")
    count = arr.size
    # The direct algorithm copies this rank's block too, piece by piece, from cache.
    own = (out_flat[comm.rank * count:(comm.rank + 1) * count], apart(arr.reshape(-1), out_flat))
    call = Call("all_gather", (out_flat, [count] * comm.size), arr.nbytes, algorithm=algorithm, result=user_out,
                staged=own, dtype=arr.dtype, count=count)
    return _run(comm, call, async_op, x, out, (id(x), id(out), "all_gather", algorithm))


def _run(comm: Communicator, call: Call, async_op: bool, x: Any, out: Any, key: Any, reads_only: bool = False) -> Any:
    """Dispatch a checked call that reads `x` and writes `out` (None: a new array, or none on a gather's other
    ranks): a blocking one is remembered for the lean path (tcoll.comm.plans), so that the same arrays skip the
    checks next time."""
    if async_op:
        return comm.core.dispatch.run(call, async_op)
    return lean_run_into(comm.core.dispatch, key, x, call, out, reads_only)


def gather(comm: Communicator, x: Any, root: int = 0, out: Any = None, *, algorithm: str = "auto",
           async_op: bool = False) -> Any:
    """Gather every rank's `x` on `root`.

    Args:
        x: a contiguous NumPy array or PyTorch CPU tensor (same shape and dtype on every rank).
        root: the rank that gets the result.
        out: on root, where to write the result, shape (size, *x.shape); ignored elsewhere.
        algorithm: "auto", or one of tcoll.algorithms("gather").
        async_op: return a Work instead of waiting.

    Returns:
        On root the array of shape (size, *x.shape); None on the other ranks.

    Raises:
        ValueError: root out of range; out has the wrong shape or dtype.
        TypeError: x or out is not a buffer.
    """
    if not async_op:  # the same arrays and arguments as a recent call (tcoll.comm.plans)
        result = again_into(comm, (id(x), id(out), "gather", root, algorithm), x, out)
        if result is not MISS:
            return result
    return _gather(comm, x, root, out, algorithm=algorithm, async_op=async_op)


@numbered("gather")
def _gather(comm: Communicator, x: Any, root: int, out: Any, *, algorithm: str, async_op: bool) -> Any:
    """gather, checked (see gather)."""
    check_peer(root, comm.size, "root")
    arr = as_array(x, writable=False, what="gather input")
    send = arr.reshape(-1)
    count = arr.size
    user_out, out_flat, copies = None, None, ()
    if comm.rank == root:
        user_out, out_flat = output(x, arr, out, (comm.size, *arr.shape), "gather")
        send = apart(send, out_flat)
        copies = ((out_flat[root * count:(root + 1) * count], send),)
    call = Call("gather", (send, out_flat, [count] * comm.size, root), arr.nbytes, algorithm=algorithm,
                result=user_out, dtype=arr.dtype, count=count, root=root, copies=copies)
    key = (id(x), id(out), "gather", root, algorithm)
    return _run(comm, call, async_op, x, out if comm.rank == root else None, key, reads_only=True)


def scatter(comm: Communicator, chunks: Any, root: int = 0, out: Any = None, *, algorithm: str = "auto",
            async_op: bool = False) -> Any:
    """Send chunk r of `root` to rank r.

    The ranks other than root learn the chunk's shape and dtype from root,
    so they need not pass `out`: on one host in the call's first step
    (tcoll.shm.described), elsewhere in a small broadcast first.

    Args:
        chunks: on root, an array of shape (size, ...) or a list of `size`
            arrays of one shape and dtype; ignored on the other ranks.
        root: the rank that holds the chunks.
        out: where to write this rank's chunk; allocated if None.
        algorithm: "auto", or one of tcoll.algorithms("scatter").
        async_op: return a Work instead of waiting.

    Returns:
        This rank's chunk.

    Raises:
        ValueError: root out of range; wrong number of chunks; chunks differ in shape
            or dtype; out does not match the chunk.
        MismatchError: out does not match the chunk root sends (raised by wait; on
            every rank, root's raising the notice of the rank whose out it was).
    """
    mine = chunks if comm.rank == root else out
    if not async_op and mine is not None:  # the same arrays and arguments as a recent call (tcoll.comm.plans)
        key = (id(chunks), id(out), "scatter", root, algorithm)
        result = again_into(comm, key, mine, out) if comm.rank == root else again(comm, key, mine)
        if result is not MISS:
            return result
    return _scatter(comm, chunks, root, out, algorithm=algorithm, async_op=async_op)


@numbered("scatter")
def _scatter(comm: Communicator, chunks: Any, root: int, out: Any, *, algorithm: str, async_op: bool) -> Any:
    """scatter, checked (see scatter)."""
    check_peer(root, comm.size, "root")
    send, like = stacked_chunks(chunks, comm.size) if comm.rank == root else (None, None)
    if algorithm != "auto":  # an unknown name fails here, before anything is sent
        comm.core.dispatch.choose("scatter", algorithm, 0, blocking=not async_op)
    if not async_op and algorithm in ("auto", "shm") and _described_direct(comm):
        return _scatter_described(comm, chunks, send, like, root, out, algorithm)
    described = np.zeros(describe.META_BYTES, dtype=np.uint8)
    if send is not None:
        described[:] = describe.encode(like)
    head = Call("scatter", (), 0, root=root, algorithm=algorithm)
    return comm.core.dispatch.run_program(_scatter_steps(comm, send, described, root, out, algorithm), head, async_op)


def _described_direct(comm: Communicator) -> bool:
    """Whether a blocking scatter runs on the arena with root's description in its first step: every rank on
    this host, a slot that holds the description and a byte of each rank's chunk after it, and no other
    algorithm forced for scatter (TCOLL_ALGO)."""
    dispatcher = comm.core.dispatch
    return (comm.size > 1 and dispatcher.chooser.forced("scatter") in (None, "shm") and dispatcher.direct_capable()
            and dispatcher.chooser.slot_bytes() >= describe.META_BYTES + comm.size)


def _scatter_described(comm: Communicator, chunks: Any, send: np.ndarray | None, like: Any, root: int, out: Any,
                       algorithm: str) -> Any:
    """scatter in one call on the arena (tcoll.shm.described); a repeated one is remembered (the lean path)."""
    dispatcher, key = comm.core.dispatch, (id(chunks), id(out), "scatter", root, algorithm)
    if send is not None:  # root
        header = describe.encode(like)
        user_out, out_flat = _scatter_output(out, *describe.decode(header))
        count = out_flat.size
        send = apart(send, out_flat)
        own = (out_flat.view(np.uint8), send[root * count:(root + 1) * count].view(np.uint8))  # (copied last)
        call = Call("scatter_described", (send.view(np.uint8), header, None, root, own), out_flat.nbytes,
                    label="scatter", algorithm=algorithm, root=root, result=user_out)
        return lean_run_into(dispatcher, key, chunks, call, out, reads_only=True)
    resolve = _Resolver(out)
    nbytes = 0 if resolve.view is None else resolve.view.nbytes
    call = Call("scatter_described", (None, None, resolve, root, None), nbytes, label="scatter", algorithm=algorithm,
                root=root, result=out)
    if out is None:
        dispatcher.run(call)
        return resolve.made
    return lean_run(dispatcher, key, out, call)


class _Resolver:
    """What a scatter's other rank does with root's description (tcoll.shm.described): check it against the
    user's `out` or, without one, make the output (kept in `made`); return its flat bytes.

    Attributes:
        accepted: the last description that matched `out` (b"": none yet); the same again passes at once,
            and an express call of the scatter expects it (tcoll.shm.express).
        bound: the description the express call made last expects (b"": none), which tcoll.shm.express
            makes anew once `accepted` moved on.
    """

    __slots__ = ("out", "view", "made", "accepted", "bound")

    def __init__(self, out: Any) -> None:
        self.out, self.made, self.accepted, self.bound = out, None, b"", b""
        self.view = None if out is None else as_array(out, writable=True, what="scatter out")

    def expected(self) -> tuple[np.ndarray, np.ndarray] | None:
        """(the description accepted last, the out's flat bytes) for the arena's kernel, or None (none yet)."""
        if self.view is None or not self.accepted:
            return None
        return np.frombuffer(self.accepted, dtype=np.uint8), self.view.reshape(-1).view(np.uint8)

    def __call__(self, header: np.ndarray) -> np.ndarray:
        if self.view is not None and header.tobytes() == self.accepted:
            return self.view.reshape(-1).view(np.uint8)
        user_out, flat = _scatter_output(self.out, *describe.decode(header))
        if self.view is None:
            self.made = user_out
        else:
            self.accepted = header.tobytes()
        return flat.view(np.uint8)


def _scatter_steps(comm: Communicator, send: np.ndarray | None, described: np.ndarray, root: int, out: Any,
                   algorithm: str) -> Program:
    """scatter as a program: root's description of the chunks, then the chunks."""
    yield Call("broadcast", (described, root), described.nbytes, label="scatter")
    kind, dtype, shape = describe.decode(described)
    user_out, out_flat = _scatter_output(out, kind, dtype, shape)
    count = out_flat.size
    if send is not None:
        send = apart(send, out_flat)
        out_flat[:] = send[root * count:(root + 1) * count]
    # Chosen only now, from root's description, so that every rank makes the same choice.
    yield Call("scatter", (send, out_flat, [count] * comm.size, root), out_flat.nbytes, algorithm=algorithm)
    return user_out


def _scatter_output(out: Any, kind: str, dtype: np.dtype, shape: tuple[int, ...]) -> tuple[Any, np.ndarray]:
    """The output of scatter for the chunk root described: the user's (checked) or a new one."""
    if out is None:
        user_out, view = describe.allocate(kind, dtype, shape)
        return user_out, view.reshape(-1)
    view = as_array(out, writable=True, what="scatter out")
    if view.shape != shape or view.dtype != dtype:
        raise MismatchError(f"scatter: the root sends chunks of shape {shape} and dtype {dtype}, "
                            f"but out has shape {view.shape} and dtype {view.dtype}")
    return out, view.reshape(-1)


def all_to_all(comm: Communicator, x: Any, out: Any = None, *, algorithm: str = "auto",
               async_op: bool = False) -> Any:
    """Send part j of `x` to rank j; receive part i of every rank i.

    Args:
        x: a contiguous array of shape (size, ...).
        out: where to write what arrives, shape x.shape; allocated if None.
        algorithm: "auto", or one of tcoll.algorithms("all_to_all").
        async_op: return a Work instead of waiting.

    Returns:
        The array whose row i came from rank i.

    Raises:
        ValueError: x.shape[0] != size; out has the wrong shape or dtype.
    """
    if not async_op:  # the same arrays and arguments as a recent call (tcoll.comm.plans)
        result = again_into(comm, (id(x), id(out), "all_to_all", algorithm), x, out)
        if result is not MISS:
            return result
    return _all_to_all(comm, x, out, algorithm=algorithm, async_op=async_op)


@numbered("all_to_all")
def _all_to_all(comm: Communicator, x: Any, out: Any, *, algorithm: str, async_op: bool) -> Any:
    """all_to_all, checked (see all_to_all)."""
    arr = as_array(x, writable=False, what="all_to_all input")
    if arr.ndim == 0 or arr.shape[0] != comm.size:
        raise ValueError(f"all_to_all needs x of shape ({comm.size}, ...): one part per rank; got {arr.shape}")
    user_out, out_flat = output(x, arr, out, arr.shape, "all_to_all")
    send = apart(arr.reshape(-1), out_flat)
    count = send.size // comm.size
    mine = slice(comm.rank * count, (comm.rank + 1) * count)
    counts = [count] * comm.size
    call = Call("all_to_all", (send, out_flat, counts, counts), send.nbytes, algorithm=algorithm, result=user_out,
                dtype=send.dtype, count=send.size, copies=((out_flat[mine], send[mine]),))
    return _run(comm, call, async_op, x, out, (id(x), id(out), "all_to_all", algorithm))
