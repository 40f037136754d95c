"""The prefix reductions: scan, exscan (arrays) and scan_object, exscan_object (Python objects).

Rank r's result combines the contributions of ranks 0..r (scan, inclusive)
or 0..r-1 (exscan, exclusive) in rank order, lower ranks on the left, so a
non-commutative op gives the product in rank order. exscan leaves rank 0's
buffer unchanged (there is nothing below it), and exscan_object returns None
on rank 0. Methods of Communicator; each goes through the dispatcher, so it
is numbered, fingerprinted and agreed on like every collective.

      rank:      0     1        2           3
      input:     a     b        c           d
      scan:      a    a.b     a.b.c      a.b.c.d
      exscan:   (a)    a       a.b        a.b.c        ((a): rank 0's buffer, unchanged)
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ..algos.team import Algorithm, Team
from ..errors import known_to_peers
from ..ops import Op
from .calls import Call, numbered
from .checks import reduction_input
from .pickling import check_failed, exchange_parts, load, try_dump

if TYPE_CHECKING:
    from .communicator import Communicator

__all__ = ["scan", "exscan", "scan_object", "exscan_object", "object_op"]


@numbered("scan")
def scan(comm: Communicator, x: Any, op: str | Op = "sum", *, algorithm: str = "auto",
         async_op: bool = False) -> Any:
    """Inclusive prefix reduction, in place: rank r's `x` becomes op(x of ranks 0..r), in rank order.

    Args:
        x: a contiguous NumPy array or PyTorch CPU tensor (same shape and dtype on every rank).
        op: a reduce op name or tcoll.Op (see all_reduce); a non-commutative op is applied in rank order.
            "avg" divides rank r's sum by r + 1.
        algorithm: "auto", or one of tcoll.algorithms("scan").
        async_op: return a Work instead of waiting.

    Returns:
        x (or a Work whose result() is x).

    Raises:
        TypeError: the op does not apply to the dtype; x is not a buffer.
        ValueError: x is not contiguous or is read-only; unknown algorithm.
    """
    return _prefix(comm, "scan", x, op, algorithm, async_op)


@numbered("exscan")
def exscan(comm: Communicator, x: Any, op: str | Op = "sum", *, algorithm: str = "auto",
           async_op: bool = False) -> Any:
    """Exclusive prefix reduction, in place: rank r's `x` becomes op(x of ranks 0..r-1), in rank order.

    Rank 0's x is left unchanged (no rank is below it), as in MPI_Exscan.

    Args:
        x: a contiguous NumPy array or PyTorch CPU tensor (same shape and dtype on every rank).
        op: a reduce op name or tcoll.Op (see all_reduce); "avg" divides rank r's sum by r.
        algorithm: "auto", or one of tcoll.algorithms("exscan").
        async_op: return a Work instead of waiting.

    Returns:
        x (or a Work whose result() is x).

    Raises:
        TypeError, ValueError: as scan.
    """
    return _prefix(comm, "exscan", x, op, algorithm, async_op)


def _prefix(comm: Communicator, collective: str, x: Any, op: str | Op, algorithm: str, async_op: bool) -> Any:
    flat, resolved = reduction_input(x, op, f"{collective} buffer")
    contributions = comm.rank + 1 if collective == "scan" else comm.rank
    call = Call(collective, (flat, resolved), flat.nbytes, op=resolved, itemsize=flat.itemsize,
                algorithm=algorithm, result=x, finish_buf=flat if contributions else None, dtype=flat.dtype,
                count=flat.size, contributions=contributions)
    return comm.core.dispatch.run(call, async_op)


# -- objects -----------------------------------------------------------------------------------


def _loc(better: Callable[[Any, Any], bool]) -> Callable[[Any, Any], Any]:
    def pick(lower: Any, higher: Any) -> Any:
        return higher if better(higher[0], lower[0]) else lower  # a tie keeps the lower index (lower rank's)

    return pick


_OBJECT_OPS: dict[str, Callable[[Any, Any], Any]] = {
    "sum": operator.add, "prod": operator.mul, "min": min, "max": max,
    "band": operator.and_, "bor": operator.or_, "bxor": operator.xor,
    "land": lambda a, b: bool(a) and bool(b), "lor": lambda a, b: bool(a) or bool(b),
    "lxor": lambda a, b: bool(a) != bool(b),
    "maxloc": _loc(operator.gt), "minloc": _loc(operator.lt),
}


def object_op(op: str | Op | Callable[[Any, Any], Any]) -> Callable[[Any, Any], Any]:
    """What `op=` of an object reduction means: fn(lower, higher) -> their combination.

    A name: sum (+), prod (*), min, max, band (&), bor (|), bxor (^), land,
    lor, lxor, and maxloc / minloc on (value, index) pairs. A tcoll.Op: its
    function. Any other callable of two arguments: itself.

    Raises:
        ValueError: an unknown name, or "avg" (no mean of objects).
        TypeError: not a name, an Op or a callable.
    """
    if isinstance(op, Op):
        return op.fn
    if isinstance(op, str):
        found = _OBJECT_OPS.get(op.lower())
        if found is None:
            raise ValueError(f"object reductions take op={', '.join(_OBJECT_OPS)} or a callable; not {op!r}")
        return found
    if callable(op):
        return op
    raise TypeError(f"op must be a name, a tcoll.Op or a callable of two arguments, not {type(op).__name__}")


@numbered("scan_object")
def scan_object(comm: Communicator, obj: Any, op: str | Op | Callable[[Any, Any], Any] = "sum", *,
                async_op: bool = False) -> Any:
    """Inclusive prefix reduction of picklable objects: op(obj of ranks 0..rank), in rank order.

    Recursive doubling (Hillis-Steele): ceil(log2 p) rounds, each sending
    the partial result to rank + 2**k as a pickle. Security: peers' objects
    are unpickled (see tcoll.comm.objects).

    Args:
        obj: a picklable object.
        op: "sum", "prod", "min", "max", ... (see object_op), a tcoll.Op, or fn(lower, higher).
        async_op: return a Work (whose result() is the object) instead of waiting.

    Returns:
        The combination; on rank 0, obj itself.

    Raises:
        TcollError: another rank could not pickle its partial result (that rank raises the pickling error).
    """
    fn = object_op(op)
    return comm.core.dispatch.run_custom("scan_object", lambda team: _object_prefix(team, obj, fn, False), async_op)


@numbered("exscan_object")
def exscan_object(comm: Communicator, obj: Any, op: str | Op | Callable[[Any, Any], Any] = "sum", *,
                  async_op: bool = False) -> Any:
    """Exclusive prefix reduction of picklable objects: op(obj of ranks 0..rank-1), in rank order.

    Args:
        obj: a picklable object.
        op: as scan_object.
        async_op: return a Work (whose result() is the object) instead of waiting.

    Returns:
        The combination; None on rank 0.

    Raises:
        TcollError: as scan_object.
    """
    fn = object_op(op)
    return comm.core.dispatch.run_custom("exscan_object", lambda team: _object_prefix(team, obj, fn, True), async_op)


def _object_prefix(team: Team, obj: Any, fn: Callable[[Any, Any], Any], exclusive: bool) -> Algorithm:
    """Hillis-Steele over objects: `partial` covers ranks max(0, r - dist + 1)..r, `below` ranks ..r-1."""
    p, r = team.size, team.rank
    label = "exscan_object" if exclusive else "scan_object"
    partial, below = obj, None
    dist = 1
    while dist < p:
        outgoing, error = {}, None
        if r + dist < p:
            outgoing[r + dist], error = try_dump(partial)
        sources = [r - dist] if r >= dist else []
        received = yield from exchange_parts(team, outgoing, sources)
        if error is not None:
            raise known_to_peers(error)
        check_failed(label, received)
        if sources:
            got = load(received[r - dist] or [])
            below = got if dist == 1 else fn(got, below)
            if r + 2 * dist < p or not exclusive:
                partial = fn(got, partial)
        dist <<= 1
    return below if exclusive else partial
