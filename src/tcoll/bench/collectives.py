"""The bench cases: one small record per collective.

A `BenchCase` says, for one collective, how big its buffers are for a
benchmark size, how to call it in tcoll, in torch.distributed (gloo) and in
mpi4py, its bus-bandwidth factor, and what the checked buffer must hold
afterwards (computed independently with NumPy from every rank's known input).

Sizes follow nccl-tests: a size is the bytes of the whole buffer -- for
all_gather its output (n per-rank blocks), for reduce_scatter its input (n
per-rank outputs), for all_to_all the whole send buffer, for gather and
scatter the root's n-block buffer, otherwise the one buffer. A case whose
buffer is made of n blocks (`split`) rounds the element count down to a
multiple of n; the others round the bytes down to whole elements.

Data: rank r's input element i is (r+1) * (i % m + 1), small integers whose
sums are exact in floating point (m shrinks for narrow dtypes and many ranks);
for "prod" it is 1 + (i + r) % 2. Outputs are filled with a value that no
input holds (-1, or 0 for unsigned types) before the checked call.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np

__all__ = [
    "CASES",
    "BenchCase",
    "Buffers",
    "Layout",
    "Params",
    "Pattern",
    "count_wrong",
    "fill",
    "layout",
    "make_buffers",
    "resolve_dtype",
]

OPS = ("sum", "prod", "min", "max")
DTYPES = ("float32", "float64", "float16", "bfloat16", "int8", "uint8", "int32", "int64")
_CHUNK = 1 << 20  # elements per step when filling and checking (bounded temporaries at 256 MiB)


def resolve_dtype(name: str) -> np.dtype:
    """The NumPy dtype of a bench dtype name (bfloat16 comes from ml_dtypes)."""
    if name == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


@dataclasses.dataclass(frozen=True)
class Layout:
    """The buffer sizes of one benchmark size.

    Attributes:
        count: elements of the size buffer (nccl-tests' count).
        block: elements of one rank's block (count // n for split cases, else count).
        nbytes: the real bytes of the size buffer, after rounding down.
    """

    count: int
    block: int
    nbytes: int


@dataclasses.dataclass(frozen=True)
class Params:
    """What one measurement runs: the world, the root, the dtype and the op."""

    n: int
    rank: int
    root: int
    dtype: np.dtype
    op: str
    algorithm: str = "auto"
    keeps_input: bool = True  # reduce leaves the non-roots' buffers unchanged (tcoll, MPI; not gloo)


@dataclasses.dataclass
class Buffers:
    """A rank's buffers: `inp` (None: scatter off the root) and `out` (None: in place, or gather off the root)."""

    inp: Any
    out: Any


Shape = tuple[int, ...] | None
Caller = Callable[[Any, Buffers, Params, Any], Callable[[], Any]]  # (handle, buffers, params, op) -> call


@dataclasses.dataclass(frozen=True)
class BenchCase:
    """One collective in the bench.

    Attributes:
        name: the collective (and the tcoll Communicator method).
        busbw_factor: bus bandwidth = algbw * busbw_factor(n) (nccl-tests PERFORMANCE.md).
        split: the size buffer is n per-rank blocks.
        reduces: the collective takes an op.
        shapes: (layout, params) -> (input shape, output shape) on this rank; None = no such buffer.
        tcoll: (comm, buffers, params, op name) -> a function making one call.
        gloo: (torch.distributed, buffers of CPU tensors, params, ReduceOp) -> a function making one call.
        mpi: (MPI communicator, buffers, params, MPI.Op) -> a function making one call.
        checked: which buffer holds the result ("inp" or "out"); None: nothing to check.
        expect: (pattern, layout, params, lo, hi) -> elements lo:hi of the checked buffer, or None
            if this rank's buffer is not checked.
    """

    name: str
    busbw_factor: Callable[[int], float]
    split: bool
    reduces: bool
    shapes: Callable[[Layout, Params], tuple[Shape, Shape]]
    tcoll: Caller
    gloo: Caller
    mpi: Caller
    checked: str | None
    expect: Callable[[Pattern, Layout, Params, int, int], np.ndarray | None]


# -- data ------------------------------------------------------------------------------------


def _inexact(dtype: np.dtype) -> bool:
    return dtype.kind == "f" or dtype.name == "bfloat16"


def _finfo(dtype: np.dtype) -> Any:
    if dtype.name == "bfloat16":
        import ml_dtypes

        return ml_dtypes.finfo(dtype)
    return np.finfo(dtype)


class Pattern:
    """Every rank's input data, and reductions of it, by element index range."""

    def __init__(self, dtype: np.dtype, op: str, n: int) -> None:
        self.dtype = dtype
        self.op = op
        self.n = n
        triangle = n * (n + 1) // 2  # the largest sum of one element over ranks, per unit of (i % m + 1)
        if _inexact(dtype):
            limit = 2 ** (_finfo(dtype).nmant + 1)
        else:
            limit = int(np.iinfo(dtype).max)
        self.period = 2 if op == "prod" else max(1, min(97, limit // triangle))
        self.garbage = 0 if dtype.kind == "u" else -1
        self._bases: dict[int, np.ndarray] = {}

    def _base(self, rank: int) -> np.ndarray:
        base = self._bases.get(rank)
        if base is None:
            i = np.arange(self.period, dtype=np.int64)
            values = 1 + (i + rank) % 2 if self.op == "prod" else (rank + 1) * (i + 1)
            base = self._bases[rank] = values.astype(np.int64).astype(self.dtype)
        return base

    def values(self, rank: int, lo: int, hi: int) -> np.ndarray:
        """Elements lo:hi of rank `rank`'s input."""
        base = np.roll(self._base(rank), -(lo % self.period))
        return np.resize(base, max(hi - lo, 0))

    def reduced(self, lo: int, hi: int) -> np.ndarray:
        """Elements lo:hi of the reduction of every rank's input, in rank order."""
        ufunc = {"sum": np.add, "prod": np.multiply, "min": np.minimum, "max": np.maximum}[self.op]
        acc = self.values(0, lo, hi).copy()
        for rank in range(1, self.n):
            ufunc(acc, self.values(rank, lo, hi), out=acc)
        return acc


def _blocks(lo: int, hi: int, block: int, part: Callable[[int, int, int], np.ndarray]) -> np.ndarray:
    """Elements lo:hi of a buffer of blocks, block b's elements j:k being part(b, j, k)."""
    pieces = []
    while lo < hi:
        b, j = divmod(lo, block)
        k = min(block, j + hi - lo)
        pieces.append(part(b, j, k))
        lo += k - j
    return np.concatenate(pieces) if pieces else np.empty(0)


def layout(case: BenchCase, nbytes: int, n: int, itemsize: int) -> Layout:
    """The buffers of `case` for a size of `nbytes` on n ranks (rounded down; barrier: empty)."""
    if case.name == "barrier":
        return Layout(0, 0, 0)
    count = nbytes // itemsize
    if case.split:
        count -= count % n
    return Layout(count, count // n if case.split else count, count * itemsize)


def make_buffers(case: BenchCase, lay: Layout, p: Params, alloc: Callable[[tuple[int, ...], np.dtype], Any]) -> Buffers:
    """This rank's buffers for one measurement, from `alloc(shape, dtype)`."""
    inp_shape, out_shape = case.shapes(lay, p)
    return Buffers(None if inp_shape is None else alloc(inp_shape, p.dtype),
                   None if out_shape is None else alloc(out_shape, p.dtype))


def fill(bufs: Buffers, pattern: Pattern, rank: int) -> None:
    """Write rank `rank`'s input data into the input and the marker value into the output."""
    if bufs.inp is not None:
        flat = bufs.inp.reshape(-1)
        for lo in range(0, flat.size, _CHUNK):
            hi = min(flat.size, lo + _CHUNK)
            flat[lo:hi] = pattern.values(rank, lo, hi)
    if bufs.out is not None:
        bufs.out.fill(pattern.garbage)


def count_wrong(case: BenchCase, bufs: Buffers, pattern: Pattern, lay: Layout, p: Params) -> int:
    """How many elements of this rank's checked buffer differ from the NumPy reference."""
    if case.checked is None:
        return 0
    got = getattr(bufs, case.checked)
    if got is None:
        return 0
    flat = got.reshape(-1)
    inexact = _inexact(p.dtype)
    rtol = 4 * p.n * float(_finfo(p.dtype).eps) if inexact else 0.0
    wrong = 0
    for lo in range(0, flat.size, _CHUNK):
        hi = min(flat.size, lo + _CHUNK)
        want = case.expect(pattern, lay, p, lo, hi)
        if want is None:
            return 0  # this rank's buffer holds nothing defined (gather off the root, ...)
        if inexact:
            ok = np.isclose(flat[lo:hi].astype(np.float64), want.astype(np.float64), rtol=rtol, atol=0.0)
            wrong += int(ok.size - np.count_nonzero(ok))
        else:
            wrong += int(np.count_nonzero(flat[lo:hi] != want))
    return wrong


# -- the cases -------------------------------------------------------------------------------
#
# A caller is (handle, buffers, params, op) -> a function making one call, where handle is the
# tcoll Communicator, the torch.distributed module or the mpi4py communicator, and op is that
# implementation's reduce op (tcoll: the name; see the backends in runner, gloo_worker, mpi_worker).
# Whatever can be looked up once is looked up before the returned function, not in it.

CASES: dict[str, BenchCase] = {}


def _case(**fields: Any) -> None:
    case = BenchCase(**fields)
    CASES[case.name] = case


def _gloo_fn(dist: Any, *names: str) -> Any:
    """The first torch.distributed function of `names` that exists (names change across versions)."""
    for name in names:
        if hasattr(dist, name):
            return getattr(dist, name)
    raise NotImplementedError(f"torch.distributed has none of {', '.join(names)}")


def _in_place() -> Any:
    from mpi4py import MPI

    return MPI.IN_PLACE


def _is_root(p: Params) -> bool:
    return p.rank == p.root


def _one(lay: Layout, p: Params) -> tuple[Shape, Shape]:
    return (lay.count,), None


def _own_block(p: Params, lay: Layout, lo: int, hi: int) -> tuple[int, int]:
    return p.rank * lay.block + lo, p.rank * lay.block + hi


def _concat(pat: Pattern, lay: Layout, lo: int, hi: int) -> np.ndarray:
    """Every rank's input block end to end (what all_gather and gather deliver)."""
    return _blocks(lo, hi, lay.block, lambda r, j, k: pat.values(r, j, k))


def _mpi_all_reduce(c: Any, b: Buffers, p: Params, op: Any) -> Callable[[], Any]:
    in_place = _in_place()
    return lambda: c.Allreduce(in_place, b.inp, op)


_case(name="all_reduce", busbw_factor=lambda n: 2 * (n - 1) / n, split=False, reduces=True, shapes=_one,
      tcoll=lambda c, b, p, op: lambda: c.all_reduce(b.inp, op, algorithm=p.algorithm),
      gloo=lambda d, b, p, op: lambda: d.all_reduce(b.inp, op),
      mpi=_mpi_all_reduce,
      checked="inp", expect=lambda pat, lay, p, lo, hi: pat.reduced(lo, hi))


def _mpi_reduce(c: Any, b: Buffers, p: Params, op: Any) -> Callable[[], Any]:
    if _is_root(p):
        in_place = _in_place()
        return lambda: c.Reduce(in_place, b.inp, op, p.root)
    return lambda: c.Reduce(b.inp, None, op, p.root)


def _reduce_expect(pat: Pattern, lay: Layout, p: Params, lo: int, hi: int) -> np.ndarray | None:
    if _is_root(p):
        return pat.reduced(lo, hi)
    return pat.values(p.rank, lo, hi) if p.keeps_input else None  # the others' input stays as it was


_case(name="reduce", busbw_factor=lambda n: 1.0, split=False, reduces=True, shapes=_one,
      tcoll=lambda c, b, p, op: lambda: c.reduce(b.inp, p.root, op, algorithm=p.algorithm),
      gloo=lambda d, b, p, op: lambda: d.reduce(b.inp, p.root, op),
      mpi=_mpi_reduce,
      checked="inp", expect=_reduce_expect)

_case(name="broadcast", busbw_factor=lambda n: 1.0, split=False, reduces=False, shapes=_one,
      tcoll=lambda c, b, p, op: lambda: c.broadcast(b.inp, p.root, algorithm=p.algorithm),
      gloo=lambda d, b, p, op: lambda: d.broadcast(b.inp, p.root),
      mpi=lambda c, b, p, op: lambda: c.Bcast(b.inp, p.root),
      checked="inp", expect=lambda pat, lay, p, lo, hi: pat.values(p.root, lo, hi))


def _gloo_all_gather(d: Any, b: Buffers, p: Params, op: Any) -> Callable[[], Any]:
    all_gather, out = _gloo_fn(d, "all_gather_single", "all_gather_into_tensor"), b.out.reshape(-1)
    return lambda: all_gather(out, b.inp)


_case(name="all_gather", busbw_factor=lambda n: (n - 1) / n, split=True, reduces=False,
      shapes=lambda lay, p: ((lay.block,), (p.n, lay.block)),
      tcoll=lambda c, b, p, op: lambda: c.all_gather(b.inp, b.out, algorithm=p.algorithm),
      gloo=_gloo_all_gather,
      mpi=lambda c, b, p, op: lambda: c.Allgather(b.inp, b.out),
      checked="out", expect=lambda pat, lay, p, lo, hi: _concat(pat, lay, lo, hi))


def _gloo_gather(d: Any, b: Buffers, p: Params, op: Any) -> Callable[[], Any]:
    rows = list(b.out.unbind(0)) if _is_root(p) else None
    return lambda: d.gather(b.inp, rows, p.root)


_case(name="gather", busbw_factor=lambda n: (n - 1) / n, split=True, reduces=False,
      shapes=lambda lay, p: ((lay.block,), (p.n, lay.block) if _is_root(p) else None),
      tcoll=lambda c, b, p, op: lambda: c.gather(b.inp, p.root, b.out, algorithm=p.algorithm),
      gloo=_gloo_gather,
      mpi=lambda c, b, p, op: lambda: c.Gather(b.inp, b.out, p.root),
      checked="out", expect=lambda pat, lay, p, lo, hi: _concat(pat, lay, lo, hi) if _is_root(p) else None)


def _gloo_scatter(d: Any, b: Buffers, p: Params, op: Any) -> Callable[[], Any]:
    rows = list(b.inp.unbind(0)) if _is_root(p) else None
    return lambda: d.scatter(b.out, rows, p.root)


_case(name="scatter", busbw_factor=lambda n: (n - 1) / n, split=True, reduces=False,
      shapes=lambda lay, p: ((p.n, lay.block) if _is_root(p) else None, (lay.block,)),
      tcoll=lambda c, b, p, op: lambda: c.scatter(b.inp, p.root, b.out, algorithm=p.algorithm),
      gloo=_gloo_scatter,
      mpi=lambda c, b, p, op: lambda: c.Scatter(b.inp, b.out, p.root),
      checked="out", expect=lambda pat, lay, p, lo, hi: pat.values(p.root, *_own_block(p, lay, lo, hi)))


def _gloo_reduce_scatter(d: Any, b: Buffers, p: Params, op: Any) -> Callable[[], Any]:
    reduce_scatter = _gloo_fn(d, "reduce_scatter_single", "reduce_scatter_tensor")
    return lambda: reduce_scatter(b.out, b.inp, op)


_case(name="reduce_scatter", busbw_factor=lambda n: (n - 1) / n, split=True, reduces=True,
      shapes=lambda lay, p: ((lay.count,), (lay.block,)),
      tcoll=lambda c, b, p, op: lambda: c.reduce_scatter(b.inp, op, b.out, algorithm=p.algorithm),
      gloo=_gloo_reduce_scatter,
      mpi=lambda c, b, p, op: lambda: c.Reduce_scatter_block(b.inp, b.out, op),
      checked="out", expect=lambda pat, lay, p, lo, hi: pat.reduced(*_own_block(p, lay, lo, hi)))


def _gloo_all_to_all(d: Any, b: Buffers, p: Params, op: Any) -> Callable[[], Any]:
    out, inp = b.out.reshape(-1), b.inp.reshape(-1)
    return lambda: d.all_to_all_single(out, inp)


def _all_to_all_expect(pat: Pattern, lay: Layout, p: Params, lo: int, hi: int) -> np.ndarray:
    """Block i of the output is block `rank` of rank i's input."""
    return _blocks(lo, hi, lay.block, lambda i, j, k: pat.values(i, *_own_block(p, lay, j, k)))


_case(name="all_to_all", busbw_factor=lambda n: (n - 1) / n, split=True, reduces=False,
      shapes=lambda lay, p: ((p.n, lay.block), (p.n, lay.block)),
      tcoll=lambda c, b, p, op: lambda: c.all_to_all(b.inp, b.out, algorithm=p.algorithm),
      gloo=_gloo_all_to_all,
      mpi=lambda c, b, p, op: lambda: c.Alltoall(b.inp, b.out),
      checked="out", expect=_all_to_all_expect)

_case(name="barrier", busbw_factor=lambda n: 1.0, split=False, reduces=False,
      shapes=lambda lay, p: (None, None),
      tcoll=lambda c, b, p, op: lambda: c.barrier(algorithm=p.algorithm),
      gloo=lambda d, b, p, op: lambda: d.barrier(),
      mpi=lambda c, b, p, op: lambda: c.Barrier(),
      checked=None, expect=lambda pat, lay, p, lo, hi: None)
