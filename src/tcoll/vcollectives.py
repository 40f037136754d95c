"""The collectives with uneven sizes (v-collectives): all_gatherv, gatherv, scatterv, all_to_allv, reduce_scatterv.

Ranks contribute arrays whose lengths along axis 0 differ; the trailing
shape and the dtype must agree. The ranks do not pass their sizes: each
call first exchanges small fixed-size descriptions (`tcoll.meta`: kind,
dtype, shape, plus row counts) in phase 0 of the call, then moves the data
in phase 1 with a registered algorithm that supports uneven counts. Both
phases run in one generator, so `async_op=True` returns a single Work.

Every rank sees every description (all_gather, or a broadcast from the
root), so a trailing shape or dtype that does not agree is a MismatchError
on every rank, before any data moves. With algorithm="auto" the data
phase's algorithm is chosen after the exchange, from sizes every rank
knows, so all ranks choose alike.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from . import meta
from .algos.registry import AlgorithmInfo
from .buffers import as_array, empty_like_kind
from .errors import MismatchError
from .ops import Op
from .schedule import Algorithm, Team
from .topology import displacements

if TYPE_CHECKING:
    from .collectives import CollectiveMethods as _Base
else:
    _Base = object

__all__ = ["VCollectiveMethods"]

_W = meta.META_BYTES  # where the int64 row counts start in a header


def _header(like: Any, rows: list[int]) -> np.ndarray:
    """A description of `like` (kind, dtype, shape) followed by the int64 row counts `rows`."""
    out = np.zeros(_W + 8 * len(rows), dtype=np.uint8)
    out[:_W] = meta.encode(like)
    out[_W:].view(np.int64)[:] = rows
    return out


class _Described:
    """What a header says: the kind, dtype and trailing shape of the rows, and the row counts."""

    __slots__ = ("dtype", "kind", "rows", "trailing")

    def __init__(self, header: np.ndarray) -> None:
        self.kind, self.dtype, shape = meta.decode(header[:_W])
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


def _rows_array(x: Any, what: str) -> np.ndarray:
    """The typed view of an input whose rows (axis 0) are counted."""
    arr = as_array(x, writable=False, what=what)
    if arr.ndim == 0:
        raise ValueError(f"{what} must have at least one dimension (its rows are axis 0); got a 0-d array")
    return arr


def _split(user_out: Any, rows: list[int]) -> list[Any]:
    """Views of consecutive row ranges of `user_out` (an array or tensor), one per count in `rows`."""
    at = displacements(rows)
    return [user_out[at[r]:at[r + 1]] for r in range(len(rows))]


def _inner(trailing: tuple[int, ...]) -> int:
    return math.prod(trailing)


class VCollectiveMethods(_Base):
    """Mixed into Communicator: the collectives with uneven sizes.

    all_gatherv, gatherv, scatterv, all_to_allv, reduce_scatterv (see the module docstring).
    """

    def _data_info(self, collective: str, algorithm: str, chosen: AlgorithmInfo, nbytes: int,
                   uneven: bool) -> AlgorithmInfo:
        """The data phase's algorithm: the one asked for, or the cost model's choice for sizes all ranks know."""
        if algorithm != "auto":
            return chosen
        return self._choose(collective, "auto", nbytes, uneven=uneven)

    def _chunk_views(self, chunks: Any, what: str) -> list[np.ndarray]:
        """Check a list of `size` arrays whose rows may differ in number but not in shape or dtype."""
        if not isinstance(chunks, (list, tuple)):
            raise TypeError(f"{what} needs a list of {self.size} arrays, one per rank; got {type(chunks).__name__}")
        if len(chunks) != self.size:
            raise ValueError(f"{what} needs {self.size} chunks, one per rank; got {len(chunks)}")
        views = [_rows_array(c, f"{what} chunk {i}") for i, c in enumerate(chunks)]
        first = views[0]
        for i, view in enumerate(views):
            if view.shape[1:] != first.shape[1:] or view.dtype != first.dtype:
                raise ValueError(f"{what} chunks must agree in trailing shape and dtype: chunk 0 has rows of shape "
                                 f"{first.shape[1:]} and dtype {first.dtype}, chunk {i} {view.shape[1:]} {view.dtype}")
        return views

    def _exchange_headers(self, team: Team, mine: np.ndarray) -> Algorithm:
        """All-gather every rank's header (phase 0 of the call); returns the table, one row per rank."""
        info = self._choose("all_gather", "auto", mine.nbytes)
        table = np.empty(team.size * mine.size, dtype=np.uint8)
        table[team.rank * mine.size:(team.rank + 1) * mine.size] = mine
        yield from info.run(team.phase(0), table, [mine.size] * team.size)
        return table

    def all_gatherv(self, x: Any, *, algorithm: str = "auto", async_op: bool = False) -> Any:
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
        arr = _rows_array(x, "all_gatherv input")
        mine = _header(x, [arr.shape[0]])
        chosen = self._choose("all_gather", algorithm, arr.nbytes, uneven=True)
        team = self._team()

        def body() -> Algorithm:
            table = yield from self._exchange_headers(team, mine)
            rows = [d.rows[0] for d in _read_table(table, team.size, "all_gatherv")]
            counts = [n * _inner(arr.shape[1:]) for n in rows]
            info = self._data_info("all_gather", algorithm, chosen, sum(counts) * arr.itemsize // team.size,
                                   len(set(counts)) > 1)
            user_out, view = empty_like_kind(x, (sum(rows), *arr.shape[1:]), arr.dtype)
            flat = view.reshape(-1)
            at = displacements(counts)
            flat[at[team.rank]:at[team.rank + 1]] = arr.reshape(-1)
            yield from info.run(team.phase(1), flat, counts)
            return _split(user_out, rows)

        return self._run(team, "all_gatherv", chosen, body(), arr.nbytes, async_op)

    def gatherv(self, x: Any, root: int = 0, *, algorithm: str = "auto", async_op: bool = False) -> Any:
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
        self._check_root(root)
        arr = _rows_array(x, "gatherv input")
        mine = _header(x, [arr.shape[0]])
        chosen = self._choose("gather", algorithm, arr.nbytes, uneven=True)
        team = self._team()

        def body() -> Algorithm:
            table = yield from self._exchange_headers(team, mine)
            rows = [d.rows[0] for d in _read_table(table, team.size, "gatherv")]
            counts = [n * _inner(arr.shape[1:]) for n in rows]
            info = self._data_info("gather", algorithm, chosen, sum(counts) * arr.itemsize // team.size,
                                   len(set(counts)) > 1)
            user_out, flat = None, None
            if team.rank == root:
                user_out, view = empty_like_kind(x, (sum(rows), *arr.shape[1:]), arr.dtype)
                flat = view.reshape(-1)
                at = displacements(counts)
                flat[at[root]:at[root + 1]] = arr.reshape(-1)
            yield from info.run(team.phase(1), arr.reshape(-1), flat, counts, root)
            return None if user_out is None else _split(user_out, rows)

        return self._run(team, "gatherv", chosen, body(), arr.nbytes, async_op)

    def scatterv(self, chunks: Any, root: int = 0, *, algorithm: str = "auto", async_op: bool = False) -> Any:
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
        self._check_root(root)
        header = np.zeros(_W + 8 * self.size, dtype=np.uint8)
        send = None
        if self.rank == root:
            views = self._chunk_views(chunks, "scatterv")
            header[:] = _header(chunks[0], [v.shape[0] for v in views])
            send = np.concatenate([v.reshape(-1) for v in views])
        chosen = self._choose("scatter", algorithm, 0 if send is None else send.nbytes // self.size, uneven=True)
        team = self._team()

        def body() -> Algorithm:
            yield from self._choose("broadcast", "auto", header.nbytes).run(team.phase(0), header, root)
            d = _Described(header)
            counts = [n * _inner(d.trailing) for n in d.rows]
            info = self._data_info("scatter", algorithm, chosen, sum(counts) * d.dtype.itemsize // team.size,
                                   len(set(counts)) > 1)
            user_out, view = meta.allocate(d.kind, d.dtype, (d.rows[team.rank], *d.trailing))
            out = view.reshape(-1)
            if send is not None:
                at = displacements(counts)
                out[:] = send[at[root]:at[root + 1]]
            yield from info.run(team.phase(1), send, out, counts, root)
            return user_out

        return self._run(team, "scatterv", chosen, body(), 0 if send is None else send.nbytes, async_op)

    def all_to_allv(self, chunks: Any, *, algorithm: str = "auto", async_op: bool = False) -> Any:
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
        views = self._chunk_views(chunks, "all_to_allv")
        mine = _header(chunks[0], [v.shape[0] for v in views])
        send = np.concatenate([v.reshape(-1) for v in views])
        chosen = self._choose("all_to_all", algorithm, send.nbytes, uneven=True)
        like, trailing, dtype = chunks[0], views[0].shape[1:], views[0].dtype
        team = self._team()

        def body() -> Algorithm:
            table = yield from self._exchange_headers(team, mine)
            described = _read_table(table, team.size, "all_to_allv")
            inner, rank = _inner(trailing), team.rank
            send_counts = [n * inner for n in described[rank].rows]
            recv_rows = [d.rows[rank] for d in described]
            recv_counts = [n * inner for n in recv_rows]
            every = {n for d in described for n in d.rows}
            total = sum(sum(d.rows) for d in described) * inner * dtype.itemsize
            info = self._data_info("all_to_all", algorithm, chosen, total // team.size, len(every) > 1)
            user_out, view = empty_like_kind(like, (sum(recv_rows), *trailing), dtype)
            out = view.reshape(-1)
            sent_at, recv_at = displacements(send_counts), displacements(recv_counts)
            out[recv_at[rank]:recv_at[rank + 1]] = send[sent_at[rank]:sent_at[rank + 1]]
            yield from info.run(team.phase(1), send, out, send_counts, recv_counts)
            return _split(user_out, recv_rows)

        return self._run(team, "all_to_allv", chosen, body(), send.nbytes, async_op)

    def reduce_scatterv(self, x: Any, counts: Sequence[int], op: str | Op = "sum", out: Any = None, *,
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
        """
        arr, op = self._reduce_input(x, op, "reduce_scatterv buffer", writable=False)
        if arr.ndim == 0:
            raise ValueError("reduce_scatterv splits x along axis 0; x is 0-d")
        rows = self._check_counts(counts, arr.shape[0])
        inner = _inner(arr.shape[1:])
        user_out, out_flat = self._output(x, arr, out, (rows[self.rank], *arr.shape[1:]), "reduce_scatterv")
        return self._reduce_scatter_run(arr.reshape(-1), out_flat, user_out, [n * inner for n in rows], op,
                                        algorithm, async_op)

    def _check_counts(self, counts: Any, total: int) -> list[int]:
        """`counts` as `size` non-negative ints summing to `total` (ValueError otherwise)."""
        if isinstance(counts, np.ndarray):
            counts = counts.tolist()
        if not isinstance(counts, (list, tuple)) or len(counts) != self.size:
            raise ValueError(f"counts must be a list of {self.size} row counts, one per rank; got {counts!r}")
        for n in counts:
            if not isinstance(n, (int, np.integer)) or isinstance(n, bool) or n < 0:
                raise ValueError(f"counts must be non-negative integers; got {counts!r}")
        if sum(counts) != total:
            raise ValueError(f"counts sum to {sum(counts)} but x has {total} rows (x.shape[0])")
        return [int(n) for n in counts]
