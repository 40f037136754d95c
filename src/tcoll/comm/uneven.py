"""The collectives with uneven sizes (v-collectives): all_gatherv, gatherv, scatterv, all_to_allv.

Ranks contribute arrays whose lengths along axis 0 differ; the trailing
shape and the dtype must agree. The ranks do not pass their sizes: each
call is a program of two steps (see `tcoll.comm.dispatch`). First the
ranks exchange small fixed-size descriptions (`tcoll.comm.describe`: kind,
dtype, shape, plus row counts), then they move the data with an algorithm
that supports uneven counts. (reduce_scatterv, whose counts every rank
passes, is in `tcoll.comm.reductions`.)

Every rank sees every description (all_gather, or a broadcast from the
root), so a trailing shape or dtype that does not agree is a MismatchError
on every rank, before any data moves. With algorithm="auto" the data
step's algorithm is chosen after the exchange, from sizes every rank
knows, so all ranks choose alike.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import numpy as np

from ..algos.topology import displacements
from ..buffers import empty_like_kind
from ..errors import MismatchError
from . import describe
from .calls import Call, Program, numbered
from .checks import check_peer, chunk_views, rows_array

if TYPE_CHECKING:
    from .communicator import Communicator

__all__ = ["all_gatherv", "gatherv", "scatterv", "all_to_allv"]

_W = describe.META_BYTES  # where the int64 row counts start in a header


def _header(like: Any, rows: list[int]) -> np.ndarray:
    """A description of `like` (kind, dtype, shape) followed by the int64 row counts `rows`."""
    out = np.zeros(_W + 8 * len(rows), dtype=np.uint8)
    out[:_W] = describe.encode(like)
    out[_W:].view(np.int64)[:] = rows
    return out


class _Described:
    """What a header says: the kind, dtype and trailing shape of the rows, and the row counts."""

    __slots__ = ("dtype", "kind", "rows", "trailing")

    def __init__(self, header: np.ndarray) -> None:
        self.kind, self.dtype, shape = describe.decode(header[:_W])
        self.trailing = shape[1:]
        self.rows = [int(n) for n in header[_W:].view(np.int64)]


def _read_table(table: np.ndarray, size: int, what: str) -> list[_Described]:
    """Decode every rank's header and check that the dtypes and trailing shapes agree."""
    described = [_Described(row) for row in table.reshape(size, -1)]
    first = described[0]
    for rank, d in enumerate(described):
        if d.dtype != first.dtype or d.trailing != first.trailing:
            raise MismatchError(
                f"{what}: rank {rank} contributes rows of shape {d.trailing} and dtype {d.dtype}, rank 0 rows "
                f"of shape {first.trailing} and dtype {first.dtype}; the trailing shape and dtype must agree")
    return described


def _split(user_out: Any, rows: list[int]) -> list[Any]:
    """Views of consecutive row ranges of `user_out` (an array or tensor), one per count in `rows`."""
    at = displacements(rows)
    return [user_out[at[r]:at[r + 1]] for r in range(len(rows))]


def _headers(comm: Communicator, mine: np.ndarray, label: str) -> Call:
    """The step that all-gathers every rank's header; its result is the table, one row per rank."""
    width = mine.size
    table = np.empty(comm.size * width, dtype=np.uint8)
    own = (table[comm.rank * width:(comm.rank + 1) * width], mine)
    return Call("all_gather", (table, [width] * comm.size), width, label=label, result=table, staged=own)


def _check_algorithm(comm: Communicator, collective: str, algorithm: str, nbytes: int, async_op: bool) -> None:
    """An algorithm asked for must run uneven counts: checked before anything is sent."""
    if algorithm != "auto":
        comm.core.dispatch.choose(collective, algorithm, nbytes, uneven=True, blocking=not async_op)


@numbered("all_gatherv")
def all_gatherv(comm: Communicator, x: Any, *, algorithm: str = "auto", async_op: bool = False) -> Any:
    """Gather every rank's `x` on every rank; the ranks' lengths along axis 0 may differ.

    Args:
        x: a contiguous NumPy array or PyTorch CPU tensor of at least one
            dimension; shape[1:] and dtype must agree on every rank.
        algorithm: "auto", or an uneven-capable one of tcoll.algorithms("all_gather").
        async_op: return a Work instead of waiting.

    Returns:
        A list of `size` arrays (tensors if x is one), entry r holding rank r's x.

    Raises:
        ValueError: x is 0-d or not contiguous; the algorithm needs equal counts.
        MismatchError: (on every rank) the trailing shapes or dtypes differ.
    """
    arr = rows_array(x, "all_gatherv input")
    _check_algorithm(comm, "all_gather", algorithm, arr.nbytes, async_op)
    head = Call("all_gather", (), 0, label="all_gatherv", algorithm=algorithm)
    return comm.core.dispatch.run_program(_all_gatherv_steps(comm, x, arr, algorithm), head, async_op)


def _all_gatherv_steps(comm: Communicator, x: Any, arr: np.ndarray, algorithm: str) -> Program:
    table = yield _headers(comm, _header(x, [arr.shape[0]]), "all_gatherv")
    rows = [d.rows[0] for d in _read_table(table, comm.size, "all_gatherv")]
    counts = [n * math.prod(arr.shape[1:]) for n in rows]
    user_out, view = empty_like_kind(x, (sum(rows), *arr.shape[1:]), arr.dtype)
    flat = view.reshape(-1)
    at = displacements(counts)
    own = (flat[at[comm.rank]:at[comm.rank + 1]], arr.reshape(-1))
    yield Call("all_gather", (flat, counts), sum(counts) * arr.itemsize // comm.size, label="all_gatherv",
               uneven=len(set(counts)) > 1, algorithm=algorithm, staged=own)
    return _split(user_out, rows)


@numbered("gatherv")
def gatherv(comm: Communicator, x: Any, root: int = 0, *, algorithm: str = "auto", async_op: bool = False) -> Any:
    """Gather every rank's `x` on `root`; the ranks' lengths along axis 0 may differ.

    Args:
        x: a contiguous NumPy array or PyTorch CPU tensor of at least one
            dimension; shape[1:] and dtype must agree on every rank.
        root: the rank that gets the result.
        algorithm: "auto", or an uneven-capable one of tcoll.algorithms("gather").
        async_op: return a Work instead of waiting.

    Returns:
        On root a list of `size` arrays (tensors if root's x is one), entry r
        holding rank r's x; None on the other ranks.

    Raises:
        ValueError: root out of range; x is 0-d or not contiguous.
        MismatchError: (on every rank) the trailing shapes or dtypes differ.
    """
    check_peer(root, comm.size, "root")
    arr = rows_array(x, "gatherv input")
    _check_algorithm(comm, "gather", algorithm, arr.nbytes, async_op)
    head = Call("gather", (), 0, label="gatherv", root=root, algorithm=algorithm)
    return comm.core.dispatch.run_program(_gatherv_steps(comm, x, arr, root, algorithm), head, async_op)


def _gatherv_steps(comm: Communicator, x: Any, arr: np.ndarray, root: int, algorithm: str) -> Program:
    table = yield _headers(comm, _header(x, [arr.shape[0]]), "gatherv")
    rows = [d.rows[0] for d in _read_table(table, comm.size, "gatherv")]
    counts = [n * math.prod(arr.shape[1:]) for n in rows]
    user_out, flat = None, None
    if comm.rank == root:
        user_out, view = empty_like_kind(x, (sum(rows), *arr.shape[1:]), arr.dtype)
        flat = view.reshape(-1)
        at = displacements(counts)
        flat[at[root]:at[root + 1]] = arr.reshape(-1)
    yield Call("gather", (arr.reshape(-1), flat, counts, root), sum(counts) * arr.itemsize // comm.size,
               label="gatherv", uneven=len(set(counts)) > 1, algorithm=algorithm)
    return None if user_out is None else _split(user_out, rows)


@numbered("scatterv")
def scatterv(comm: Communicator, chunks: Any, root: int = 0, *, algorithm: str = "auto",
             async_op: bool = False) -> Any:
    """Send chunks[r] of `root` to rank r; the chunks' lengths along axis 0 may differ.

    The other ranks learn the shape, dtype and lengths from root (a small
    broadcast comes first).

    Args:
        chunks: on root, a list of `size` NumPy arrays or PyTorch CPU tensors
            of at least one dimension, of one trailing shape and dtype;
            ignored on the other ranks.
        root: the rank that holds the chunks.
        algorithm: "auto", or an uneven-capable one of tcoll.algorithms("scatter").
        async_op: return a Work instead of waiting.

    Returns:
        This rank's chunk (a new array, or tensor if root's chunks are tensors).

    Raises:
        ValueError: (on root) wrong number of chunks; chunks differ in trailing shape or dtype.
        TypeError: (on root) chunks is not a list.
    """
    check_peer(root, comm.size, "root")
    header = np.zeros(_W + 8 * comm.size, dtype=np.uint8)
    send = None
    if comm.rank == root:
        views = chunk_views(chunks, comm.size, "scatterv")
        header[:] = _header(chunks[0], [v.shape[0] for v in views])
        send = np.concatenate([v.reshape(-1) for v in views])
    _check_algorithm(comm, "scatter", algorithm, 0 if send is None else send.nbytes // comm.size, async_op)
    head = Call("scatter", (), 0, label="scatterv", root=root, algorithm=algorithm)
    return comm.core.dispatch.run_program(_scatterv_steps(comm, header, send, root, algorithm), head, async_op)


def _scatterv_steps(comm: Communicator, header: np.ndarray, send: np.ndarray | None, root: int,
                    algorithm: str) -> Program:
    yield Call("broadcast", (header, root), header.nbytes, label="scatterv")
    d = _Described(header)
    counts = [n * math.prod(d.trailing) for n in d.rows]
    user_out, view = describe.allocate(d.kind, d.dtype, (d.rows[comm.rank], *d.trailing))
    out = view.reshape(-1)
    if send is not None:
        at = displacements(counts)
        out[:] = send[at[root]:at[root + 1]]
    yield Call("scatter", (send, out, counts, root), sum(counts) * d.dtype.itemsize // comm.size, label="scatterv",
               uneven=len(set(counts)) > 1, algorithm=algorithm)
    return user_out


@numbered("all_to_allv")
def all_to_allv(comm: Communicator, chunks: Any, *, algorithm: str = "auto", async_op: bool = False) -> Any:
    """Send chunks[j] to rank j and receive one chunk from every rank; lengths along axis 0 may differ.

    Every rank's description (dtype, trailing shape, and its row count for
    each destination) is all-gathered first: size * (256 + 8 * size)
    bytes per rank.

    Args:
        chunks: a list of `size` NumPy arrays or PyTorch CPU tensors of at
            least one dimension; shape[1:] and dtype must agree on every rank.
        algorithm: "auto", or an uneven-capable one of tcoll.algorithms("all_to_all").
        async_op: return a Work instead of waiting.

    Returns:
        The list of what arrived, entry i coming from rank i (tensors if chunks[0] is one).

    Raises:
        ValueError, TypeError: chunks is not a list of `size` arrays of one trailing shape and dtype.
        MismatchError: (on every rank) the ranks' trailing shapes or dtypes differ.
    """
    views = chunk_views(chunks, comm.size, "all_to_allv")
    mine = _header(chunks[0], [v.shape[0] for v in views])
    if not async_op and algorithm in ("auto", "shm") and _direct(comm, mine.size, algorithm):
        return _all_to_allv_direct(comm, chunks[0], views, mine)
    send = np.concatenate([v.reshape(-1) for v in views])
    _check_algorithm(comm, "all_to_all", algorithm, send.nbytes, async_op)
    program = _all_to_allv_steps(comm, chunks[0], views[0], mine, send, algorithm)
    head = Call("all_to_all", (), 0, label="all_to_allv", algorithm=algorithm)
    return comm.core.dispatch.run_program(program, head, async_op)


def _all_to_allv_steps(comm: Communicator, like: Any, first: np.ndarray, mine: np.ndarray, send: np.ndarray,
                       algorithm: str) -> Program:
    table = yield _headers(comm, mine, "all_to_allv")
    described = _read_table(table, comm.size, "all_to_allv")
    trailing, dtype, rank = first.shape[1:], first.dtype, comm.rank
    inner = math.prod(trailing)
    send_counts = [n * inner for n in described[rank].rows]
    recv_rows = [d.rows[rank] for d in described]
    recv_counts = [n * inner for n in recv_rows]
    every = {n for d in described for n in d.rows}
    total = sum(sum(d.rows) for d in described) * inner * dtype.itemsize
    user_out, view = empty_like_kind(like, (sum(recv_rows), *trailing), dtype)
    out = view.reshape(-1)
    sent_at, recv_at = displacements(send_counts), displacements(recv_counts)
    out[recv_at[rank]:recv_at[rank + 1]] = send[sent_at[rank]:sent_at[rank + 1]]
    yield Call("all_to_all", (send, out, send_counts, recv_counts), total // comm.size, label="all_to_allv",
               uneven=len(every) > 1, algorithm=algorithm)
    return _split(user_out, recv_rows)


def _direct(comm: Communicator, width: int, algorithm: str) -> bool:
    """Whether a blocking all_to_allv runs on the arena (else "auto" makes it a program of two steps).

    It needs every rank on this host, and a slot that holds the headers
    (`width` bytes each) with room for a byte per rank after them.

    Raises:
        ValueError: algorithm "shm", and the slot is too small.
    """
    if not comm.core.dispatch.direct_capable():
        return False
    slot = comm.core.dispatch.chooser.slot_bytes()
    if comm.size == 1 or slot >= width + comm.size:
        return True
    if algorithm == "shm":
        raise ValueError(f"all_to_allv algorithm 'shm': the shared-memory slot ({slot} B) cannot hold the "
                         f"counts of {comm.size} ranks ({width} B each); raise TCOLL_SHM_SLOT")
    return False


def _all_to_allv_direct(comm: Communicator, like: Any, views: list[np.ndarray],
                        mine: np.ndarray) -> list[Any] | None:
    """all_to_allv in one call on the arena: the headers travel in its first step, with the data."""
    if comm.core.dispatch.capturing:  # a plan: its runs call all_to_allv anew (the result is made in arrived)
        return None
    first, rank, size = views[0], comm.rank, comm.size
    trailing, dtype = first.shape[1:], first.dtype
    row_bytes = math.prod(trailing) * dtype.itemsize
    result: list[list[Any]] = []
    width, meta = mine.size, mine[:_W].tobytes()

    def arrived(table: np.ndarray) -> tuple[np.ndarray, list[int], int]:
        if any(table[q * width:q * width + _W].tobytes() != meta for q in range(size)):
            _read_table(table, size, "all_to_allv")  # descriptions differ (not when chunk 0s agree): check them
        matrix = np.ndarray((size, size), np.int64, table, _W, (width, 8)).tolist()  # [q][d]: rows q sends d
        recv_rows = [row[rank] for row in matrix]
        user_out, view = empty_like_kind(like, (sum(recv_rows), *trailing), dtype)
        out = view.reshape(-1).view(np.uint8)
        mine_at = sum(recv_rows[:rank]) * row_bytes
        out[mine_at:mine_at + views[rank].nbytes] = views[rank].reshape(-1).view(np.uint8)
        result.append(_split(user_out, recv_rows))
        return out, [n * row_bytes for n in recv_rows], max(map(max, matrix)) * row_bytes

    blocks = [v.reshape(-1).view(np.uint8) for v in views]
    call = Call("all_to_allv", (mine, blocks, arrived), sum(b.size for b in blocks) // size, label="all_to_allv")
    comm.core.dispatch.run(call)
    return result[0]
