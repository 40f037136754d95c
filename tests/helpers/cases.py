"""Inputs and NumPy references for the collective tests.

Every rank's input is a function of (rank, position, dtype, op), so any rank
(or the test process) can compute what every other rank contributed and
reduce it with NumPy, in rank order, independently of tcoll. Integer,
bool, min/max and bitwise results must match exactly; float sums, products
and averages within `tolerance`.
"""

from __future__ import annotations

import functools

import ml_dtypes
import numpy as np

import tcoll
from tcoll.ops import OPS, dtype_kind

BF16 = np.dtype(ml_dtypes.bfloat16)
ALL_DTYPES = [np.dtype(d) for d in ("bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32",
                                    "uint64", "float16", "float32", "float64", "complex64", "complex128")] + [BF16]
# One dtype per kind plus the awkward ones, for the ops other than sum.
SOME_DTYPES = [np.dtype(d) for d in ("bool", "int8", "uint32", "int64", "float16", "float32", "float64",
                                     "complex64")] + [BF16]
LOC_DTYPES = [np.dtype(d) for d in ("float32", "float64", "int32")]
MATRIX = np.dtype([("m", np.int64, (2, 2))])  # one 2x2 matrix per element: product is not commutative
EPS = {np.dtype("float16"): 2.0 ** -10, BF16: 2.0 ** -7, np.dtype("float32"): 2.0 ** -23,
       np.dtype("float64"): 2.0 ** -52}


def _matmul(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    out = np.empty_like(a)
    out["m"] = a["m"] @ b["m"]
    return out


MATMUL = tcoll.Op(_matmul, commutative=False, name="matmul")


def valid_pairs(dtypes: list[np.dtype]) -> list[tuple[str, np.dtype]]:
    """Every (op name, dtype) the op accepts, over `dtypes`, plus the loc ops and the matrix op."""
    pairs = []
    for name, op in OPS.items():
        if name in ("maxloc", "minloc"):
            pairs += [(name, d) for d in LOC_DTYPES]
            continue
        for dtype in dtypes if name != "sum" else ALL_DTYPES:
            try:
                op.check(dtype)
            except TypeError:
                continue
            pairs.append((name, dtype))
    return pairs + [("matmul", MATRIX)]


def op_of(name: str) -> tcoll.Op:
    return MATMUL if name == "matmul" else OPS[name]


def make_input(rank: int, count: int, dtype: np.dtype, op: str) -> np.ndarray:
    """Rank `rank`'s contribution: `count` elements, values chosen so the reduction stays meaningful."""
    i = np.arange(count, dtype=np.int64)
    if op in ("maxloc", "minloc"):
        values = ((rank * 7 + i * 3) % 5).astype(dtype)  # many ties between ranks
        return tcoll.loc_pairs(values, rank * 1000 + i)
    if op == "matmul":
        out = np.zeros(count, dtype=MATRIX)
        out["m"][:, 0, 0] = 1 + (rank + i) % 2
        out["m"][:, 0, 1] = (rank * 3 + i) % 3
        out["m"][:, 1, 0] = (rank + 2 * i) % 2
        out["m"][:, 1, 1] = 1
        return out
    kind = dtype_kind(dtype)
    if kind == "bool":
        return ((rank * 3 + i) % 4 == 0) | ((rank + i) % 5 == 1)
    if kind == "int":
        raw = rank * 1_000_003 + i * 7919 + 12345
        return (raw % 97 if op == "prod" else raw).astype(dtype)
    if op == "prod":
        real = 1.0 + ((rank + i) % 5) * 0.1
    elif op in ("land", "lor", "lxor"):
        real = ((rank + i) % 3) * 0.5
    else:
        real = np.sin(rank * 1.7 + i * 0.31) * 3.0
    if kind == "complex":
        return (real + 1j * np.cos(rank + i * 0.5)).astype(dtype)
    return real.astype(dtype)


def reference(op: str, stacked: list[np.ndarray]) -> np.ndarray:
    """Reduce the ranks' inputs in rank order with NumPy (float sums in float64)."""
    if op in ("maxloc", "minloc"):
        better = np.greater if op == "maxloc" else np.less
        result = stacked[0].copy()
        for other in stacked[1:]:
            take = better(other["value"], result["value"]) | (
                (other["value"] == result["value"]) & (other["index"] < result["index"]))
            result = np.where(take, other, result)
        return result
    if op == "matmul":
        return functools.reduce(_matmul, stacked)
    data = np.stack(stacked)
    dtype = data.dtype
    if op in ("sum", "avg", "prod") and dtype_kind(dtype) in ("float", "complex"):
        wide = data.astype(np.complex128 if dtype.kind == "c" else np.float64)
        total = wide.sum(axis=0) if op != "prod" else wide.prod(axis=0)
        return total / len(stacked) if op == "avg" else total
    ufunc = {"sum": np.add, "prod": np.multiply, "min": np.minimum, "max": np.maximum,
             "band": np.bitwise_and, "bor": np.bitwise_or, "bxor": np.bitwise_xor, "land": np.logical_and,
             "lor": np.logical_or, "lxor": np.logical_xor}[op]
    return ufunc.reduce(data, axis=0).astype(dtype)


def tolerance(dtype: np.dtype, size: int, op: str) -> float | None:
    """Absolute tolerance per unit of magnitude for float results; None means exact."""
    base = np.dtype(np.float32 if dtype == np.dtype("complex64") else
                    np.float64 if dtype == np.dtype("complex128") else dtype)
    if op not in ("sum", "avg", "prod") or base not in EPS:
        return None
    return 4 * (size + 1) * EPS[base]


def assert_reduced(got: np.ndarray, stacked: list[np.ndarray], op: str, what: str) -> None:
    """Assert that `got` is the reduction of `stacked` under `op` (exact or within tolerance)."""
    want = reference(op, stacked)
    tol = tolerance(got.dtype, len(stacked), op)
    if tol is None:
        if not np.array_equal(got.view(np.uint8), np.ascontiguousarray(want).view(np.uint8)):
            raise AssertionError(f"{what}: got {got[:6]}..., want {want[:6]}...")
        return
    scale = np.abs(np.stack(stacked).astype(np.complex128)).sum(axis=0) + 1.0
    if op == "prod":
        scale = np.abs(want) + 1.0
    err = np.abs(got.astype(np.complex128) - want)
    if not np.all(err <= tol * scale):
        worst = int(np.argmax(err - tol * scale))
        raise AssertionError(f"{what}: element {worst} is {got[worst]}, want {want[worst]} (tol {tol:g} x scale)")


def pattern(rank: int, count: int, dtype: np.dtype, salt: int = 0) -> np.ndarray:
    """Data-movement input: distinct per rank, position and salt, for any dtype."""
    raw = ((np.arange(count * dtype.itemsize, dtype=np.int64) * 131 + rank * 7919 + salt * 31) % 113).astype(np.uint8)
    if dtype.kind == "b":
        return (raw % 2).astype(bool)
    if dtype.kind == "f" or dtype == BF16:
        return (raw[:count].astype(np.float32) / 4).astype(dtype)  # finite values only
    if dtype.kind == "c":
        return (raw[:count] + 1j * raw[::-1][:count]).astype(dtype)
    return raw.view(dtype) if dtype.itemsize > 0 else raw


def runnable(comm: tcoll.Communicator, collective: str) -> list[str]:
    """The algorithms of `collective` that `comm` can run blocking: the shared-memory ones need one host."""
    from tcoll.algos.registry import lookup

    one_host = comm.size == 1 or comm.transport((comm.rank + 1) % comm.size) != "tcp"
    return [name for name in tcoll.algorithms(collective) if one_host or not lookup(collective, name).direct]
