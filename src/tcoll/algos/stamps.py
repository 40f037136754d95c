"""Call stamps: what a collective call is, in 128 bits that every message and arena descriptor of the call carries.

Ranks that make the same call compute the same stamp; ranks that disagree
(another collective, op, dtype, element count, root or algorithm) compute
different ones, and a receiver that compares the stamp of an arriving
message with its own sees the disagreement at the first message, with no
message of its own. A stamp is decodable, so the error can say what each
side called:

    low word   bits  0- 5  the user's call (all_reduce, all_gatherv, scan, ...)
               bits  6- 9  the collective of this step (a program's steps differ)
               bits 10-15  the reduce op (0: none; 1-31 the built-in ops; 32-63 a user op:
                           32 + 5 bits of its identity, tcoll.Op.identity)
               bits 16-23  the dtype (0: none; a code of its own for each built-in NumPy type, each
                           datetime64 and timedelta64 unit, (value, index) pairs; 255: any other)
               bits 24-28  the algorithm (its index in the registry, plus 1; 31: unknown)
               bits 29-52  the root (0 for calls without one; a reduce_scatterv: a digest of its counts)
               bits 53-62  10 more bits of a user op's identity
               bit  63     NOTICE: a control message about the call (see tcoll.comm.dispatch)
    high word  bits  0-35  the element count of this rank's part, modulo 2**36 (0: not compared)
               bits 36-43  8 more bits of a user op's identity (23 in all)
               bits 44-63  for "any other" dtype (byte and unicode strings, records, datetimes
                           with a multiplier...): 20 bits of a digest of its full description

So two different user ops, or two different dtypes outside the table,
share a stamp with a chance of 1 in 2**23 (2**20): the fields that name
them are digests, not names.

The sequence number of the call is not in the stamp: it is in every
message's tag, and in the arena's descriptors next to the stamp.
"""

from __future__ import annotations

import functools
import hashlib

import ml_dtypes
import numpy as np

from ..ops import OPS, Op
from .registry import COLLECTIVES, REGISTRY

__all__ = ["LABELS", "NOTICE", "MASK", "stamp", "counts_digest", "describe", "differences"]

# The calls a user makes (append only: codes are positions).
LABELS = (
    "", "all_reduce", "reduce", "broadcast", "all_gather", "gather", "scatter", "reduce_scatter", "all_to_all",
    "barrier", "all_gatherv", "gatherv", "scatterv", "all_to_allv", "reduce_scatterv", "broadcast_object",
    "all_gather_object", "gather_object", "scatter_object", "split", "scan", "exscan", "scan_object",
    "exscan_object", "all_to_all_object", "call",
)
_LABEL = {name: code for code, name in enumerate(LABELS)}
_COLLECTIVE = {name: code for code, name in enumerate(("", *COLLECTIVES))}
assert len(_COLLECTIVE) <= 16, "a stamp has 4 bits for the collective of a step"
_OP_NAMES = ("", *OPS)  # built-in ops; a user op is 32 + 5 bits of its identity
_USER_OP = 32
_TIME_UNITS = ("generic", "Y", "M", "W", "D", "h", "m", "s", "ms", "us", "ns", "ps", "fs", "as")
_DTYPES = (None, np.bool_, np.int8, np.uint8, np.int16, np.uint16, np.int32, np.uint32, np.int64, np.uint64,
           np.float16, ml_dtypes.bfloat16, np.float32, np.float64, np.complex64, np.complex128, np.longdouble,
           np.clongdouble,
           *(np.dtype("M8" if unit == "generic" else f"M8[{unit}]") for unit in _TIME_UNITS),
           *(np.dtype("m8" if unit == "generic" else f"m8[{unit}]") for unit in _TIME_UNITS))
assert len(_DTYPES) <= 64, "a stamp has 6 bits for a dtype's code (then big-endian and pair flags)"
_DTYPE = {np.dtype(t): code for code, t in enumerate(_DTYPES) if t is not None}
_OTHER_DTYPE, _SWAPPED, _LOC = 255, 64, 128

NOTICE = 1 << 63
MASK = (1 << 64) - 1
_ROOT_BITS = 24
_ALGORITHM_BITS = 5
_COUNT_BITS = 36
_OP_LOW_BITS, _OP_HIGH_BITS, _DTYPE_DIGEST_BITS = 10, 8, 20


def stamp(label: str, collective: str, op: Op | None, dtype: np.dtype | None, count: int, root: int,
          algorithm: str | None) -> int:
    """The stamp of one call (or one step of a program), as one 128-bit integer (low | high << 64)."""
    op_code, op_low, op_high = _op_fields(op)
    dtype_code, dtype_digest = _dtype_fields(dtype)
    low = (_LABEL.get(label, _LABEL["call"]) | _COLLECTIVE.get(collective, 0) << 6 | op_code << 10
           | dtype_code << 16 | _algorithm_code(collective, algorithm) << 24
           | (root & ((1 << _ROOT_BITS) - 1)) << 29 | op_low << 53)
    high = count & ((1 << _COUNT_BITS) - 1) | op_high << 36 | dtype_digest << 44
    return low | high << 64


def counts_digest(counts: list[int]) -> int:
    """24 bits of a digest of a per-rank counts list, for the root field of a call that takes one (reduce_scatterv)."""
    digest = hashlib.blake2b(repr([int(n) for n in counts]).encode(), digest_size=4).digest()
    return int.from_bytes(digest, "little") & ((1 << _ROOT_BITS) - 1)


# What this process made stamps of, to name them in errors: user ops and other dtypes by their digest bits.
_SEEN_OPS: dict[tuple[int, int, int], str] = {}
_SEEN_DTYPES: dict[int, str] = {}


def _op_fields(op: Op | None) -> tuple[int, int, int]:
    """(op code, 10 more bits, 8 more bits) of `op`: a built-in op's code, or a user op's identity."""
    if op is None:
        return 0, 0, 0
    if OPS.get(op.name) is op:
        return _OP_NAMES.index(op.name), 0, 0
    identity = op.identity
    fields = (_USER_OP | identity & 31, identity >> 5 & ((1 << _OP_LOW_BITS) - 1),
              identity >> (5 + _OP_LOW_BITS) & ((1 << _OP_HIGH_BITS) - 1))
    if fields not in _SEEN_OPS and len(_SEEN_OPS) < 1024:
        _SEEN_OPS[fields] = op.name
    return fields


@functools.lru_cache(maxsize=256)
def _dtype_fields(dtype: np.dtype | None) -> tuple[int, int]:
    """(dtype code, digest): a code of the table, or 255 and 20 bits of a digest of the dtype's description."""
    code = _dtype_code(dtype)
    if code != _OTHER_DTYPE:
        return code, 0
    assert dtype is not None
    text = repr((dtype.str, dtype.descr, dtype.itemsize, dtype.names, dtype.shape)).encode()
    digest = int.from_bytes(hashlib.blake2b(text, digest_size=4).digest(), "little") & ((1 << _DTYPE_DIGEST_BITS) - 1)
    if len(_SEEN_DTYPES) < 1024:
        _SEEN_DTYPES.setdefault(digest, str(dtype))
    return code, digest


@functools.lru_cache(maxsize=256)
def _dtype_code(dtype: np.dtype | None) -> int:
    if dtype is None:
        return 0
    if dtype.names == ("value", "index"):  # maxloc / minloc pairs: the value's type
        return _LOC | (_dtype_code(dtype["value"]) & 63)
    code = _DTYPE.get(dtype.newbyteorder("=") if dtype.byteorder == ">" else dtype)
    if code is None:
        return _OTHER_DTYPE
    return code | (_SWAPPED if dtype.byteorder == ">" else 0)


@functools.lru_cache(maxsize=512)
def _algorithm_code(collective: str, algorithm: str | None) -> int:
    if not algorithm or collective not in REGISTRY:
        return 0
    names = list(REGISTRY[collective])
    unknown = (1 << _ALGORITHM_BITS) - 1
    return min(names.index(algorithm) + 1, unknown) if algorithm in names else unknown


# -- reading a stamp back ------------------------------------------------------------------------


def _fields(value: int) -> dict[str, object]:
    low, high = value & MASK, value >> 64
    collective = _name(("", *COLLECTIVES), low >> 6 & 15)
    op_fields = (low >> 10 & 63, low >> 53 & ((1 << _OP_LOW_BITS) - 1), high >> 36 & ((1 << _OP_HIGH_BITS) - 1))
    fields: dict[str, object] = {
        "call": _name(LABELS, low & 63) or "a collective",
        "collective": collective,
        "op": _op_name(op_fields),
        "dtype": _dtype_name(low >> 16 & 255, high >> 44),
        "algorithm": _algorithm_name(collective, low >> 24 & ((1 << _ALGORITHM_BITS) - 1)),
        "root": low >> 29 & ((1 << _ROOT_BITS) - 1),
        "count": high & ((1 << _COUNT_BITS) - 1),
    }
    return fields


def _name(names: tuple[str, ...], code: int) -> str:
    return names[code] if code < len(names) else f"#{code}"


def _op_name(fields: tuple[int, int, int]) -> str:
    code = fields[0]
    if code < _USER_OP:
        return _name(_OP_NAMES, code)
    tag = f"#{code & 31 | fields[1] << 5 | fields[2] << 15:06x}"  # the identity bits the stamp holds
    name = _SEEN_OPS.get(fields)
    return f"user op {name!r} {tag}" if name is not None else f"a user op {tag}"


def _dtype_name(code: int, digest: int) -> str:
    if code == 0:
        return ""
    if code == _OTHER_DTYPE:
        name = _SEEN_DTYPES.get(digest)
        return f"{name} #{digest:05x}" if name is not None else f"another dtype #{digest:05x}"
    if code & _LOC:
        return f"({_dtype_name(code & 63, 0)}, int64) pairs"
    base = _DTYPES[code & 63] if (code & 63) < len(_DTYPES) else None
    name = "?" if base is None else str(np.dtype(base))
    return f"big-endian {name}" if code & _SWAPPED else name


def _algorithm_name(collective: str, code: int) -> str:
    if code == 0 or collective not in REGISTRY:
        return ""
    names = list(REGISTRY[collective])
    return names[code - 1] if code - 1 < len(names) else "an unknown algorithm"


def describe(value: int, keys: tuple[str, ...] | None = None) -> str:
    """A stamp as the call it stands for, e.g. "all_reduce(op=max, float32, 4 elements)".

    Args:
        value: the stamp.
        keys: which fields to show (default: those that are set).
    """
    fields = _fields(value)
    shown = keys or ("op", "root", "dtype", "count", "algorithm")
    parts = []
    for key in shown:
        item = fields[key]
        if key == "op" and item:
            parts.append(f"op={item}")
        elif key == "root" and (item or "root" in (keys or ())) and fields["call"] in _ROOTED:
            parts.append(f"root={item}")
        elif key == "root" and item and fields["call"] == "reduce_scatterv":
            parts.append(f"counts #{item:06x}")
        elif key == "dtype" and item:
            parts.append(str(item))
        elif key == "count" and (item or keys):
            parts.append(f"{item} element{'s' if item != 1 else ''}")
        elif key == "algorithm" and item:
            parts.append(f"algorithm {item}")
    return f"{fields['call']}({', '.join(parts)})"


_ROOTED = {"reduce", "broadcast", "gather", "scatter", "gatherv", "scatterv", "broadcast_object", "gather_object",
           "scatter_object"}


def differences(mine: int, theirs: int) -> tuple[str, ...]:
    """The fields in which two stamps differ (to show just those in an error)."""
    a, b = _fields(mine), _fields(theirs)
    if a["call"] != b["call"]:
        return ("op", "root", "dtype", "count")
    return tuple(key for key in ("op", "root", "dtype", "count", "algorithm") if a[key] != b[key]) or ("count",)


def disagreement(their_rank: int, theirs: int, my_rank: int, mine: int) -> str:
    """One sentence on how two ranks' calls differ, showing the fields that differ.

    Example: "rank 3 called all_reduce(op=max) where rank 0 called all_reduce(op=sum)".
    """
    keys = differences(mine, theirs)
    return f"rank {their_rank} called {describe(theirs, keys)} where rank {my_rank} called {describe(mine, keys)}"
