"""Reduce ops without communication: which dtypes each accepts, and what combine computes."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import tcoll
from tcoll.ops import OPS, as_op, dtype_kind

BF16 = np.dtype(ml_dtypes.bfloat16)
DTYPES = [np.dtype(d) for d in ("bool", "int8", "uint16", "int64", "uint64", "float16", "float32", "float64",
                                "complex64", "complex128")] + [BF16]

ACCEPTS = {
    "sum": {"bool", "int", "float", "complex"},
    "prod": {"bool", "int", "float", "complex"},
    "min": {"bool", "int", "float"},
    "max": {"bool", "int", "float"},
    "avg": {"float", "complex"},
    "band": {"bool", "int"},
    "bor": {"bool", "int"},
    "bxor": {"bool", "int"},
    "land": {"bool", "int", "float"},
    "lor": {"bool", "int", "float"},
    "lxor": {"bool", "int", "float"},
    "maxloc": {"loc"},
    "minloc": {"loc"},
}


def test_every_op_has_an_acceptance_rule() -> None:
    assert set(ACCEPTS) == set(OPS)


@pytest.mark.parametrize("name", sorted(OPS))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_op_dtype_acceptance(name: str, dtype: np.dtype) -> None:
    op = as_op(name)
    if dtype_kind(dtype) in ACCEPTS[name]:
        op.check(dtype)
    else:
        with pytest.raises(TypeError, match=name):
            op.check(dtype)


@pytest.mark.parametrize("name", ["sum", "prod", "min", "max", "band", "bor", "bxor", "land", "lor", "lxor"])
def test_builtin_combine_matches_the_numpy_ufunc(name: str) -> None:
    ufunc = {"sum": np.add, "prod": np.multiply, "min": np.minimum, "max": np.maximum, "band": np.bitwise_and,
             "bor": np.bitwise_or, "bxor": np.bitwise_xor, "land": np.logical_and, "lor": np.logical_or,
             "lxor": np.logical_xor}[name]
    a = np.array([0, 3, -2, 7, 5], dtype=np.int32)
    b = np.array([1, 3, 4, -7, 0], dtype=np.int32)
    out = a.copy()
    as_op(name).combine(out, b, out)
    np.testing.assert_array_equal(out, ufunc(a, b).astype(np.int32))


def test_avg_divides_at_finish() -> None:
    x = np.array([2.0, 4.0], dtype=np.float32)
    tcoll.AVG.finish(x, 4)
    np.testing.assert_array_equal(x, [0.5, 1.0])
    y = np.array([2.0], dtype=BF16)
    tcoll.AVG.finish(y, 2)
    assert float(y[0]) == 1.0


@pytest.mark.parametrize("name,pick", [("maxloc", np.argmax), ("minloc", np.argmin)])
def test_loc_ops_keep_the_best_value_and_the_lower_index_on_ties(name: str, pick: object) -> None:
    lower = tcoll.loc_pairs([1.0, 5.0, 2.0, 3.0], [0, 1, 9, 4])
    higher = tcoll.loc_pairs([1.0, 4.0, 6.0, 3.0], [7, 2, 3, 2])
    out = lower.copy()
    as_op(name).combine(lower, higher, out)
    for i in range(4):
        pair = [lower[i], higher[i]]
        values = [p["value"] for p in pair]
        best = pick(values)  # type: ignore[operator]
        if values[0] == values[1]:
            assert out[i]["index"] == min(lower[i]["index"], higher[i]["index"])
        else:
            assert out[i] == pair[best]


def test_loc_pairs_layout() -> None:
    pairs = tcoll.loc_pairs(np.arange(3, dtype=np.float32), 7)
    assert pairs.dtype.names == ("value", "index")
    assert pairs["value"].dtype == np.float32 and pairs["index"].dtype == np.int64
    assert list(pairs["index"]) == [7, 7, 7]


def test_user_op_function_and_ufunc() -> None:
    op = tcoll.Op(lambda a, b: a * 10 + b, commutative=False, name="digits")
    out = np.array([1, 2])
    op.combine(out, np.array([3, 4]), out)
    assert list(out) == [13, 24] and not op.commutative
    op2 = tcoll.Op(np.hypot)
    out2 = np.array([3.0])
    op2.combine(out2, np.array([4.0]), out2)
    assert out2[0] == 5.0 and op2.commutative


def test_as_op_errors() -> None:
    assert as_op("SUM") is tcoll.SUM
    assert as_op(tcoll.MAX) is tcoll.MAX
    with pytest.raises(ValueError, match="unknown reduce op"):
        as_op("mean")
    with pytest.raises(TypeError):
        as_op(3)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        tcoll.Op(5)  # type: ignore[arg-type]
