"""Argument checks shared by the communicator's calls: they raise before anything is sent.

A bad argument is a ValueError or TypeError on the rank that passed it,
never a message on the wire.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..buffers import as_array, empty_like_kind
from ..ops import Op, as_op

__all__ = ["MAX_TAG", "check_peer", "check_tag", "reduction_input", "output", "apart", "row_counts",
           "rows_array", "chunk_views", "stacked_chunks"]

MAX_TAG = (1 << 62) - 1


def check_peer(peer: Any, size: int, name: str) -> None:
    """Raise ValueError unless `peer` is a rank of a communicator of `size` ranks (NumPy integers too)."""
    if type(peer) is int and 0 <= peer < size:
        return
    if not isinstance(peer, (int, np.integer)) or isinstance(peer, bool) or not 0 <= peer < size:
        raise ValueError(f"{name}={peer!r} is not a rank of this communicator (0 <= {name} < {size})")


def check_tag(tag: Any) -> None:
    """Raise ValueError unless `tag` is an integer in [0, 2**62)."""
    if type(tag) is int and 0 <= tag <= MAX_TAG:
        return
    if not isinstance(tag, int) or isinstance(tag, bool) or not 0 <= tag <= MAX_TAG:
        raise ValueError(f"tag={tag!r} must be an integer in [0, 2**62)")


def reduction_input(x: Any, op: str | Op, what: str, writable: bool = True) -> tuple[np.ndarray, Op]:
    """A reduction's buffer as a typed view, and its op checked against the dtype.

    Returns:
        (flat view if `writable`, else the view in its own shape; the resolved op).
    """
    arr = as_array(x, writable=writable, what=what)
    resolved = as_op(op)
    resolved.check(arr.dtype)
    return (arr.reshape(-1) if writable else arr), resolved


def output(like: Any, arr: np.ndarray, out: Any, shape: tuple[int, ...], what: str) -> tuple[Any, np.ndarray]:
    """The user's output (checked) or a new one of the input's kind; returns (object, flat view)."""
    if out is None:
        user_out, view = empty_like_kind(like, shape, arr.dtype)
        return user_out, view.reshape(-1)
    view = as_array(out, writable=True, what=f"{what} out")
    if view.shape != shape or view.dtype != arr.dtype:
        raise ValueError(f"{what} out must have shape {shape} and dtype {arr.dtype}; "
                         f"got {view.shape} {view.dtype}")
    return out, view.reshape(-1)


def apart(source: np.ndarray, out: np.ndarray | None) -> np.ndarray:
    """`source`, or a copy of it when `out` overlaps it: an output may overlap the input (MPI's IN_PLACE).

    The call then reads the input as it was when the call began, whatever the
    algorithm writes into `out` meanwhile.
    """
    if out is not None and out.size and source.size and np.may_share_memory(source, out):
        return source.copy()
    return source


def row_counts(counts: Any, size: int, total: int) -> list[int]:
    """`counts` as `size` non-negative ints summing to `total` (ValueError otherwise)."""
    if isinstance(counts, np.ndarray):
        counts = counts.tolist()
    if not isinstance(counts, (list, tuple)) or len(counts) != size:
        raise ValueError(f"counts must be a list of {size} row counts, one per rank; got {counts!r}")
    for n in counts:
        if not isinstance(n, (int, np.integer)) or isinstance(n, bool) or n < 0:
            raise ValueError(f"counts must be non-negative integers; got {counts!r}")
    if sum(counts) != total:
        raise ValueError(f"counts sum to {sum(counts)} but x has {total} rows (x.shape[0])")
    return [int(n) for n in counts]


def rows_array(x: Any, what: str) -> np.ndarray:
    """The typed view of an input whose rows (axis 0) are counted."""
    arr = as_array(x, writable=False, what=what)
    if arr.ndim == 0:
        raise ValueError(f"{what} must have at least one dimension (its rows are axis 0); got a 0-d array")
    return arr


def chunk_views(chunks: Any, size: int, what: str) -> list[np.ndarray]:
    """Check a list of `size` arrays whose rows may differ in number but not in shape or dtype."""
    if not isinstance(chunks, (list, tuple)):
        raise TypeError(f"{what} needs a list of {size} arrays, one per rank; got {type(chunks).__name__}")
    if len(chunks) != size:
        raise ValueError(f"{what} needs {size} chunks, one per rank; got {len(chunks)}")
    views = [rows_array(c, f"{what} chunk {i}") for i, c in enumerate(chunks)]
    first = views[0]
    for i, view in enumerate(views):
        if view.shape[1:] != first.shape[1:] or view.dtype != first.dtype:
            raise ValueError(f"{what} chunks must agree in trailing shape and dtype: chunk 0 has rows of shape "
                             f"{first.shape[1:]} and dtype {first.dtype}, chunk {i} {view.shape[1:]} {view.dtype}")
    return views


def stacked_chunks(chunks: Any, size: int) -> tuple[np.ndarray, Any]:
    """scatter's chunks on the root as one flat array (a list is stacked), and one chunk to make outputs like."""
    if isinstance(chunks, (list, tuple)):
        if len(chunks) != size:
            raise ValueError(f"scatter needs {size} chunks, one per rank; got {len(chunks)}")
        views = [as_array(c, writable=False, what=f"scatter chunk {i}") for i, c in enumerate(chunks)]
        first = views[0]
        for i, view in enumerate(views):
            if view.shape != first.shape or view.dtype != first.dtype:
                raise ValueError(f"scatter chunks must share shape and dtype: chunk 0 is {first.shape} "
                                 f"{first.dtype}, chunk {i} is {view.shape} {view.dtype}")
        stacked = np.stack(views) if views else np.empty(0)
        return stacked.reshape(-1), chunks[0]
    arr = as_array(chunks, writable=False, what="scatter chunks")
    if arr.ndim == 0 or arr.shape[0] != size:
        raise ValueError(f"scatter needs chunks of shape ({size}, ...) on the root; got {arr.shape}")
    return arr.reshape(-1), chunks[0]
