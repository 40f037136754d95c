"""Reduce operations: what `op=` accepts, checked against dtypes, applied in place.

An `Op` combines two same-shaped arrays elementwise: `combine(lower, higher,
out)` writes op(lower, higher) into `out`, where `lower` holds the
contribution of the lower ranks. Built-in ops are NumPy ufuncs called with
`out=`, so no temporary is made; no communication happens here.

maxloc and minloc work on (value, index) pairs stored as a NumPy structured
array with the fields "value" and "index" (see `loc_pairs`); the lower index
wins a tie, as in MPI.
"""

from __future__ import annotations

import functools
import hashlib
import types
from collections.abc import Callable
from typing import Any

import ml_dtypes
import numpy as np

__all__ = [
    "Op", "as_op", "loc_pairs", "OPS",
    "SUM", "PROD", "MIN", "MAX", "AVG", "BAND", "BOR", "BXOR", "LAND", "LOR", "LXOR", "MAXLOC", "MINLOC",
]

_BFLOAT16 = np.dtype(ml_dtypes.bfloat16)


def dtype_kind(dtype: np.dtype) -> str:
    """Classify a dtype: "bool", "int", "float", "complex", "loc" (maxloc pairs) or "other"."""
    if dtype.names == ("value", "index"):
        return "loc"
    if dtype == _BFLOAT16:
        return "float"
    return {"b": "bool", "i": "int", "u": "int", "f": "float", "c": "complex"}.get(dtype.kind, "other")


class Op:
    """A reduce operation.

    Args:
        fn: `fn(a, b)` returns the elementwise combination of `a` (from lower
            ranks) with `b` (from higher ranks); it must be associative. A
            NumPy ufunc is called with `out=` (no temporary).
        commutative: whether fn(a, b) == fn(b, a). A non-commutative op is
            applied in rank order; only algorithms that keep that order run it.
        name: how the op is shown in messages and tables.
    """

    __slots__ = ("fn", "commutative", "name", "_kinds", "_ufunc", "_accepted", "_identity")

    def __init__(self, fn: Callable[[Any, Any], Any], commutative: bool = True, name: str | None = None,
                 kinds: frozenset[str] | None = None) -> None:
        if not callable(fn):
            raise TypeError(f"Op needs a callable, got {type(fn).__name__}")
        self.fn = fn
        self.commutative = bool(commutative)
        self.name = name or getattr(fn, "__name__", "user op")
        self._kinds = kinds  # None: a user op, any dtype
        self._ufunc = fn if isinstance(fn, np.ufunc) else None
        self._accepted: set[np.dtype] = set()  # dtypes check() already passed (calls repeat them)
        self._identity: int | None = None

    @property
    def identity(self) -> int:
        """A 64-bit number that is the same for the same op in every process, and differs for different ones.

        It is made of the op's name, whether it commutes, and its function: the
        function's module and qualified name, and a digest of its code (the
        bytecode, constants and names, recursively, and the values of simple
        closure variables). Two lambdas defined in one place share a qualified
        name but not their code, so they differ. Python's hash() is salted per
        process, so a digest (BLAKE2b) is used instead.
        """
        if self._identity is None:
            digest = hashlib.blake2b(f"{self.name}|{self.commutative}|".encode(), digest_size=8)
            digest.update(_function_key(self.fn))
            self._identity = int.from_bytes(digest.digest(), "little")
        return self._identity

    def check(self, dtype: np.dtype) -> None:
        """Raise TypeError if this op cannot reduce `dtype` (before anything is sent).

        A user op accepts every dtype, structured ones included: its function decides.
        """
        if dtype in self._accepted:
            return
        kind = dtype_kind(dtype)
        if self._kinds is not None and kind not in self._kinds:
            raise TypeError(f"reduce op {self.name!r} does not apply to dtype {dtype} "
                            f"(it takes {', '.join(sorted(self._kinds))} data)")
        self._accepted.add(dtype)

    def combine(self, lower: np.ndarray, higher: np.ndarray, out: np.ndarray) -> None:
        """Write op(lower, higher) into `out` (which may be `lower` or `higher`)."""
        if self._ufunc is not None:
            self._ufunc(lower, higher, out=out)
        else:
            result = self.fn(lower, higher)
            if result is not out:
                out[...] = result

    def combine_all(self, parts: list[np.ndarray], out: np.ndarray) -> None:
        """out = parts[0] op parts[1] op ... in rank order, with no temporary (`out` aliases no part)."""
        if len(parts) == 1:
            out[...] = parts[0]
            return
        if self._ufunc is not None and len(parts) == 2:  # the common case: one ufunc call
            self._ufunc(parts[0], parts[1], out=out)
            return
        self.combine(parts[0], parts[1], out)
        for part in parts[2:]:
            self.combine(out, part, out)

    def finish(self, result: np.ndarray, size: int) -> None:
        """Final touch on a complete reduction of `size` contributions (avg divides)."""

    def __repr__(self) -> str:
        return f"<tcoll.Op {self.name}{'' if self.commutative else ' (non-commutative)'}>"


_SIMPLE = (int, float, complex, str, bytes, bool, type(None))


def _function_key(fn: Any) -> bytes:
    """What tells a reduce function from another, as bytes that are the same in every process (see Op.identity)."""
    if isinstance(fn, np.ufunc):
        return f"ufunc:{fn.__name__}".encode()
    if isinstance(fn, functools.partial):
        return b"partial:" + _function_key(fn.func) + repr((fn.args, sorted(fn.keywords.items()))).encode()
    target = getattr(fn, "__func__", fn)  # a bound method: its function
    code = getattr(target, "__code__", None)
    if code is None and not isinstance(fn, type):  # a callable object: its class and its __call__
        target = type(fn)
        code = getattr(getattr(target, "__call__", None), "__code__", None)
    where = f"{getattr(target, '__module__', None)}:{getattr(target, '__qualname__', type(target).__qualname__)}"
    key = where.encode()
    if code is not None:
        key += _code_key(code)
    for cell in getattr(target, "__closure__", None) or ():
        try:
            value = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        key += repr(value).encode() if isinstance(value, _SIMPLE) else type(value).__qualname__.encode()
    return key


def _code_key(code: types.CodeType) -> bytes:
    """A code object's bytecode, names and constants (nested code objects too), as deterministic bytes."""
    parts = [code.co_code, repr((code.co_names, code.co_varnames, code.co_freevars)).encode()]
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            parts.append(_code_key(const))
        elif isinstance(const, frozenset):  # its order follows salted string hashes: sort it
            parts.append(repr(sorted(map(repr, const))).encode())
        else:
            parts.append(repr(const).encode())
    return b"\0".join(parts)


class _Average(Op):
    """The mean over ranks: a sum, divided by the number of ranks at the end."""

    __slots__ = ()

    def finish(self, result: np.ndarray, size: int) -> None:
        if size > 1:
            np.true_divide(result, result.dtype.type(size), out=result)


class _Logical(Op):
    """A logical op: the result is 1 or 0 (True or False) even when no two operands met (one rank)."""

    __slots__ = ()

    def finish(self, result: np.ndarray, size: int) -> None:
        np.not_equal(result, 0, out=result, casting="unsafe")


def _loc(better: Callable[[np.ndarray, np.ndarray], np.ndarray]) -> Callable[[np.ndarray, np.ndarray], np.ndarray]:
    """Build maxloc/minloc: keep the better value; on a tie, the lower index (MPI's rule)."""

    def pick(lower: np.ndarray, higher: np.ndarray) -> np.ndarray:
        lv, hv = lower["value"], higher["value"]
        take = better(hv, lv) | ((hv == lv) & (higher["index"] < lower["index"]))
        return np.where(take, higher, lower)

    return pick


_NUM = frozenset({"bool", "int", "float", "complex"})
_ORDERED = frozenset({"bool", "int", "float"})
_BITS = frozenset({"bool", "int"})
_LOC = frozenset({"loc"})

SUM = Op(np.add, True, "sum", _NUM)
PROD = Op(np.multiply, True, "prod", _NUM)
MIN = Op(np.minimum, True, "min", _ORDERED)
MAX = Op(np.maximum, True, "max", _ORDERED)
AVG = _Average(np.add, True, "avg", frozenset({"float", "complex"}))
BAND = Op(np.bitwise_and, True, "band", _BITS)
BOR = Op(np.bitwise_or, True, "bor", _BITS)
BXOR = Op(np.bitwise_xor, True, "bxor", _BITS)
LAND = _Logical(np.logical_and, True, "land", _ORDERED)
LOR = _Logical(np.logical_or, True, "lor", _ORDERED)
LXOR = _Logical(np.logical_xor, True, "lxor", _ORDERED)
MAXLOC = Op(_loc(np.greater), True, "maxloc", _LOC)
MINLOC = Op(_loc(np.less), True, "minloc", _LOC)

OPS: dict[str, Op] = {op.name: op for op in (SUM, PROD, MIN, MAX, AVG, BAND, BOR, BXOR, LAND, LOR, LXOR,
                                             MAXLOC, MINLOC)}


def as_op(op: str | Op) -> Op:
    """Resolve `op=` (a name such as "sum", or an Op) to an Op.

    Raises:
        ValueError: an unknown name.
        TypeError: neither a name nor an Op.
    """
    if isinstance(op, Op):
        return op
    if isinstance(op, str):
        found = OPS.get(op.lower())
        if found is None:
            raise ValueError(f"unknown reduce op {op!r}; choose one of {', '.join(OPS)} or pass tcoll.Op(fn)")
        return found
    raise TypeError(f"op must be a name such as 'sum' or a tcoll.Op, not {type(op).__name__}")


def loc_pairs(values: Any, indices: Any) -> np.ndarray:
    """Pack values and indices into the (value, index) array that maxloc/minloc reduce.

    Args:
        values: the numbers to compare (any real dtype).
        indices: the index carried with each value (converted to int64).

    Returns:
        A structured array with fields "value" and "index", of the broadcast shape.
    """
    values = np.asarray(values)
    indices = np.asarray(indices, dtype=np.int64)
    shape = np.broadcast_shapes(values.shape, indices.shape)
    pairs = np.empty(shape, dtype=[("value", values.dtype), ("index", np.int64)])
    pairs["value"] = values
    pairs["index"] = indices
    return pairs
