"""Tensor helpers of the torch backend that need no torch internals: byte views, copies."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from typing import Any

import ml_dtypes
import numpy as np
import torch

from ..buffers import as_array

__all__ = ["NATIVE", "Contiguous", "as_bytes", "check_count", "fill", "finisher", "kept", "np_bytes", "typed",
           "np_view", "pieces", "reduce_source", "reduce_target", "row_bytes", "trunc_divide"]

_U8 = torch.uint8
_BF16 = np.dtype(ml_dtypes.bfloat16)


KEPT_VIEWS, KEPT_VIEW_BYTES = 64, 64 << 10  # views kept, and the largest tensor whose view is kept
_kept: dict[tuple[Any, ...], np.ndarray] = {}


def kept(t: torch.Tensor, tag: tuple[Any, ...], make: Callable[[torch.Tensor], np.ndarray]) -> np.ndarray:
    """make(t): the very same ndarray each time for the same small tensor memory (address, length, dtype; `tag`
    names what `make` makes of it).

    tcoll knows a repeated call by its arrays' identity (its lean and express paths: tcoll.comm.plans), and a
    tensor's NumPy view is a new array at every call. A kept view is exactly a function of its key: it covers
    numel * itemsize bytes from that address, of that dtype, shaped by `tag`; `t` is contiguous (the callers
    see to it), so a key found again is a view of `t`'s own memory, whatever happened to the tensor the view
    was first made of. A kept view holds that tensor's storage, so only tensors whose whole storage is at
    most KEPT_VIEW_BYTES are kept, at most KEPT_VIEWS of them (all dropped when full); a tensor with its
    conjugate or negative bit set is never (its NumPy view would not say so).
    """
    if t.untyped_storage().nbytes() > KEPT_VIEW_BYTES or t.is_conj() or t.is_neg():
        return make(t)
    key = (t.data_ptr(), t.numel(), t.dtype, *tag)
    view = _kept.get(key)
    if view is None:
        if len(_kept) >= KEPT_VIEWS:
            _kept.clear()
        view = _kept[key] = make(t)
    return view


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a contiguous tensor of any dtype."""
    flat = t.detach().reshape(-1)
    return flat if flat.dtype == _U8 else flat.view(_U8)


def np_view(t: torch.Tensor) -> np.ndarray:
    """An ndarray over the memory of the contiguous tensor `t`, of its dtype and shape (bfloat16 via ml_dtypes).

    tcoll takes tensors too; handing it an ndarray skips its per-call dtype lookup.
    """
    t = t.detach()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(_BF16)
    return t.numpy()


def typed(t: torch.Tensor) -> np.ndarray:
    """A flat ndarray over the memory of the contiguous tensor `t` whose dtype says what `t` holds.

    tcoll's call stamp includes the dtype, so ranks that pass tensors of
    different dtypes to a call that moves bytes (broadcast, all_gather) get a
    MismatchError instead of reading each other's bytes as their own. A dtype
    NumPy lacks (float8 types, complex32) is a record of one void field named
    after the torch dtype, which the stamp tells apart by its description.
    """
    flat = t.detach().reshape(-1)
    if flat.dtype in NATIVE:
        return np_view(flat)
    return np_bytes(flat).view(_record(flat.dtype))


@functools.lru_cache(maxsize=64)
def _record(dtype: torch.dtype) -> np.dtype:
    return np.dtype([(str(dtype), f"V{torch.empty(0, dtype=dtype).element_size()}")])


def np_bytes(t: torch.Tensor) -> np.ndarray:
    """A flat uint8 ndarray over the memory of the contiguous tensor `t` (any dtype)."""
    return as_bytes(t).numpy()


# dtypes tcoll reduces natively (NumPy or ml_dtypes views); the others (float8 types, complex32) are reduced
# in a float32 (complex64) copy.
NATIVE = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int8, torch.int16, torch.int32,
                    torch.int64, torch.uint8, torch.uint16, torch.uint32, torch.uint64, torch.bool,
                    torch.complex64, torch.complex128})


def _wide(dtype: torch.dtype) -> torch.dtype:
    """The dtype a non-native dtype is reduced in (float8 types in float32, complex32 in complex64)."""
    return torch.complex64 if dtype.is_complex else torch.float32


def reduce_source(t: torch.Tensor, factor: Any, wide: torch.dtype | None = None) -> torch.Tensor:
    """What tcoll reduces for the input `t`: `t` itself, or a contiguous copy (premultiplied by `factor`
    unless it is None, or widened: to `wide` if given, else for dtypes tcoll does not reduce)."""
    native = t.dtype in NATIVE and wide is None
    if native and factor is None and t.is_contiguous():
        return t.detach()
    with torch.no_grad():
        src = t.detach().to(t.dtype if native else wide or _wide(t.dtype), copy=True).contiguous()
        if factor is not None:  # an integer tensor's products are rounded toward zero
            src.copy_(src * factor)
    return src


def reduce_target(t: torch.Tensor, wide: torch.dtype | None = None) -> torch.Tensor:
    """Where tcoll writes a reduction's result meant for `t`: `t` itself, or a contiguous (widened) buffer."""
    native = t.dtype in NATIVE and wide is None
    if native and t.is_contiguous():
        return t.detach()
    return torch.empty(t.shape, dtype=t.dtype if native else wide or _wide(t.dtype))


def finisher(buf: torch.Tensor, t: torch.Tensor, int_avg: bool, size: int) -> Callable[[], None]:
    """What completes a reduction whose result tcoll left in `buf`: the integer average's division
    (when `int_avg`), then the copy into `t` if `buf` is not `t`."""

    def back() -> None:
        with torch.no_grad():
            if int_avg and size > 1:
                trunc_divide(buf, size)
            if buf.data_ptr() != t.data_ptr() or not t.is_contiguous():
                t.copy_(buf.view(t.shape))

    return back


def trunc_divide(buf: torch.Tensor, size: int) -> None:
    """buf //= size in place, rounding toward zero (an integer average), for every integer dtype."""
    a = as_array(buf, writable=True)
    negative_inexact = (a < 0) & (a % size != 0) if a.dtype.kind == "i" else None
    np.floor_divide(a, a.dtype.type(size), out=a)
    if negative_inexact is not None:
        a += negative_inexact.astype(a.dtype)


class Contiguous:
    """A contiguous tensor to hand tcoll for `t`: `t` itself, or a copy written back by `back()`."""

    __slots__ = ("t", "work")

    def __init__(self, t: torch.Tensor, copy_in: bool = True) -> None:
        self.t = t
        if t.is_contiguous():
            self.work = t.detach()
        else:
            fresh = torch.empty_like(t, memory_format=torch.contiguous_format)
            self.work = t.detach().contiguous() if copy_in else fresh

    def back(self) -> None:
        if self.work.data_ptr() != self.t.data_ptr() or not self.t.is_contiguous():
            with torch.no_grad():
                self.t.copy_(self.work)


def fill(outputs: Sequence[torch.Tensor], parts: Sequence[Any]) -> None:
    """Copy each received byte block into its output tensor (any dtype, any layout)."""
    with torch.no_grad():
        if isinstance(parts, np.ndarray) and len(parts) == len(outputs) and all(o.is_contiguous() for o in outputs):
            rows = torch.from_numpy(parts.reshape(len(outputs), -1).view(np.uint8))  # (one view for all the rows)
            for out, row in zip(outputs, rows):
                as_bytes(out).copy_(row)
            return
        for out, part in zip(outputs, parts, strict=True):
            data = as_bytes(part) if isinstance(part, torch.Tensor) else torch.from_numpy(part.reshape(-1).view(np.uint8))
            holder = Contiguous(out, copy_in=False)
            as_bytes(holder.work).copy_(data.reshape(-1))
            holder.back()


def check_count(tensors: Sequence[Any], size: int, what: str) -> None:
    """Refuse a list that does not hold one tensor per rank.

    Raises:
        ValueError: naming `what` and both counts.
    """
    if len(tensors) != size:
        raise ValueError(f"{what} must hold {size} tensors (one per rank), not {len(tensors)}")


def row_bytes(t: torch.Tensor, splits: Sequence[int], size: int, what: str) -> list[int]:
    """Bytes each rank's part of `t` takes: splits (rows along dim 0), or `size` equal parts."""
    row = math.prod(t.shape[1:]) * t.element_size() if t.dim() else t.element_size()
    if not splits:
        rows = t.shape[0] if t.dim() else 1
        if rows % size:
            raise ValueError(f"all_to_all_single: the {what}'s first dimension ({rows}) does not split into "
                             f"{size} equal parts")
        return [rows // size * row] * size
    if len(splits) != size or sum(splits) != (t.shape[0] if t.dim() else 1):
        raise ValueError(f"all_to_all_single: {what} split sizes {list(splits)} must be {size} row counts "
                         f"adding up to {t.shape[0] if t.dim() else 1}")
    return [int(n) * row for n in splits]


def pieces(flat: torch.Tensor, sizes: Sequence[int]) -> list[torch.Tensor]:
    at, out = 0, []
    for n in sizes:
        out.append(flat[at:at + n])
        at += n
    return out
