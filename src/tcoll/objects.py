"""Collectives and point-to-point on picklable Python objects.

Methods of Communicator: broadcast_object, all_gather_object,
gather_object, scatter_object (these four also take async_op=True), and
send_object / recv_object.

An object travels as its pickle (protocol 5) in parts: the pickle stream,
then each large out-of-band buffer (a NumPy array's data, ...) as a message
of its own, sent straight from the object's memory: no concatenation copy
and no limit on a part's size, so a multi-GiB array inside an object moves
like an array. Buffers under 64 KiB stay in the stream (fewer messages).
As with an array send, the object's arrays must not change until the call
(or, with async_op, its Work) completes.
The receiver allocates each part and unpickles with `buffers=`; arrays in
the result share memory with those parts (no further copy).

The sizes travel first, in a fixed-size record of int64 (the number of
parts and up to seven sizes; more sizes follow in one extra message), then
the parts. A rank that cannot pickle its object still takes part, sending
a record that says so: it raises the pickling error, and the ranks that
expected its object raise TcollError instead of waiting for it.

Routes: broadcast_object broadcasts the record, then each part, with the
broadcast algorithm the cost model picks for that part's size.
gather_object and scatter_object send directly between the root and each
rank (no rank forwards another's parts, so nothing is copied), and
all_gather_object sends each rank's parts directly to every other rank:
each rank sends and receives p-1 objects' worth, as a ring all-gather
does, but in one step instead of p-1.

Security: these functions unpickle what peers send, and unpickling can run
arbitrary code. The peers are the authenticated ranks of the same job, so
this trusts them exactly as much as the job trusts its own ranks; do not
pass data that came from outside the job through object collectives.
"""

from __future__ import annotations

import pickle
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, cast

import numpy as np

from .errors import MismatchError, TcollError
from .schedule import Algorithm, Team
from .work import RecvWork, Work

if TYPE_CHECKING:
    from .collectives import CollectiveMethods as _Base
else:
    _Base = object

__all__ = ["ObjectMethods", "dump", "load"]

INLINE_BYTES = 1 << 16  # out-of-band buffers smaller than this are pickled in-band
_SLOTS = 7  # part sizes a record holds; the rest travel in an overflow message
_FAILED = -1  # a record's part count when the sender could not pickle its object

Parts = list[np.ndarray]  # the pickle stream, then the out-of-band buffers: flat uint8 views


def dump(obj: Any) -> Parts:
    """Pickle `obj` (protocol 5) into parts: the stream, then its large out-of-band buffers (not copied)."""
    buffers: Parts = []

    def out_of_band(buf: pickle.PickleBuffer) -> bool:
        try:
            raw = buf.raw()
        except BufferError:  # not contiguous: let pickle copy it in-band
            return True
        if raw.nbytes < INLINE_BYTES:
            return True
        buffers.append(np.asarray(raw))
        return False

    stream = pickle.dumps(obj, protocol=5, buffer_callback=out_of_band)
    return [np.frombuffer(stream, dtype=np.uint8), *buffers]


def load(parts: Parts) -> Any:
    """Unpickle what `dump` made (arrays in the result share memory with the buffer parts)."""
    return pickle.loads(parts[0].data, buffers=parts[1:])


def _copy_load(parts: Parts) -> Any:
    """Unpickle this rank's own parts into an independent copy."""
    return pickle.loads(parts[0].data, buffers=[part.copy() for part in parts[1:]])


def _record(parts: Parts | None) -> tuple[np.ndarray, np.ndarray]:
    """The fixed-size size record of `parts` (None: pickling failed) and the overflow sizes."""
    record = np.zeros(_SLOTS + 1, dtype=np.int64)
    if parts is None:
        record[0] = _FAILED
        return record, np.empty(0, dtype=np.int64)
    sizes = [part.nbytes for part in parts]
    record[0] = len(sizes)
    record[1:1 + min(len(sizes), _SLOTS)] = sizes[:_SLOTS]
    return record, np.array(sizes[_SLOTS:], dtype=np.int64)


def _overflow_for(record: np.ndarray) -> np.ndarray:
    """A buffer for the overflow sizes that `record` announces."""
    return np.empty(max(0, int(record[0]) - _SLOTS), dtype=np.int64)


def _allocate(record: np.ndarray, overflow: np.ndarray) -> Parts | None:
    """Receive buffers for the parts that `record` and `overflow` describe (None: the sender failed)."""
    if record[0] == _FAILED:
        return None
    sizes = [int(n) for n in record[1:1 + min(int(record[0]), _SLOTS)]] + [int(n) for n in overflow]
    return [np.empty(n, dtype=np.uint8) for n in sizes]


def _outgoing(team: Team, parts: Parts | None, peer: int) -> list[Work]:
    """Send the record, the overflow sizes and the parts to `peer`, in that order, on one stream."""
    record, overflow = _record(parts)
    works = [team.send(record, peer)]
    if overflow.size:
        works.append(team.send(overflow, peer))
    return works + [team.send(part, peer) for part in parts or ()]


def _exchange(team: Team, outgoing: dict[int, Parts | None], sources: list[int]) -> Algorithm:
    """Send each peer its parts and receive parts from each source, straight from and into memory.

    Returns {source: its parts, or None if it could not pickle}.
    """
    sends = [work for peer, parts in outgoing.items() for work in _outgoing(team, parts, peer)]
    records = {src: np.empty(_SLOTS + 1, dtype=np.int64) for src in sources}
    yield [team.recv(record, src) for src, record in records.items()]
    overflows = {src: _overflow_for(record) for src, record in records.items()}
    more = [team.recv(overflow, src) for src, overflow in overflows.items() if overflow.size]
    if more:
        yield more
    received = {src: _allocate(records[src], overflows[src]) for src in sources}
    yield sends + [team.recv(part, src) for src, parts in received.items() for part in parts or ()]
    return received


def _check_failed(what: str, received: dict[int, Parts | None]) -> None:
    failed = sorted(src for src, parts in received.items() if parts is None)
    if failed:
        raise TcollError(f"{what}: rank {failed[0]} could not pickle its object")


def _try_dump(obj: Any) -> tuple[Parts | None, BaseException | None]:
    """dump(obj), or (None, the error) when it cannot be pickled."""
    try:
        return dump(obj), None
    except Exception as exc:  # noqa: BLE001 - pickling can raise almost anything; it is re-raised later
        return None, exc


class ObjectMethods(_Base):
    """Mixed into Communicator: collectives on picklable Python objects.

    broadcast_object, all_gather_object, gather_object, scatter_object,
    send_object, recv_object. See the module docstring for how objects
    travel, and its security note: these methods unpickle what the other
    ranks of the job send.
    """

    if TYPE_CHECKING:  # Communicator's point-to-point, which this mixin uses
        def isend(self, buf: Any, dst: int, tag: int = 0) -> Work: ...
        def irecv(self, buf: Any, src: int, tag: int = 0) -> Work: ...
        def _check_peer(self, peer: Any, name: str) -> None: ...
        @staticmethod
        def _check_tag(tag: Any) -> None: ...

    def _run_objects(self, team: Team, what: str, body: Algorithm, async_op: bool) -> Any:
        """Start `body` as a CollectiveWork; wait for it unless async_op."""
        return self._start(team, f"{what} #{team.sequence}", body, async_op)

    def broadcast_object(self, obj: Any, root: int = 0, *, async_op: bool = False) -> Any:
        """Send the object `obj` of `root` to every rank.

        The sizes are broadcast first, then the pickle stream and each large
        buffer, each with a broadcast algorithm chosen for its size.

        Args:
            obj: on root, a picklable object; ignored on the other ranks.
            root: the rank whose object is sent.
            async_op: return a Work (whose result() is the object) instead of waiting.

        Returns:
            On root, `obj` itself; elsewhere the unpickled copy.

        Raises:
            ValueError: root out of range.
            TcollError: (off root) root could not pickle its object; root raises the pickling error.
        """
        self._check_root(root)
        at_root = self.rank == root
        mine, error = _try_dump(obj) if at_root else (None, None)
        record, mine_overflow = _record(mine) if at_root else (np.zeros(_SLOTS + 1, np.int64), None)
        team = self._team()

        def body() -> Algorithm:
            yield from self._choose("broadcast", "auto", record.nbytes).run(team.phase(0), record, root)
            if record[0] == _FAILED:
                if error is not None:
                    raise error
                raise TcollError(f"broadcast_object: root {root} could not pickle its object")
            overflow = _overflow_for(record) if mine_overflow is None else mine_overflow
            if overflow.size:
                yield from self._choose("broadcast", "auto", overflow.nbytes).run(team.phase(1), overflow, root)
            parts = mine if at_root else _allocate(record, overflow)
            for part in parts or ():  # one after the other on phase 2's streams: FIFO keeps them apart
                yield from self._choose("broadcast", "auto", part.nbytes).run(team.phase(2), part, root)
            return obj if at_root else load(parts or [])

        return self._run_objects(team, "broadcast_object", body(), async_op)

    def all_gather_object(self, obj: Any, *, async_op: bool = False) -> Any:
        """Gather every rank's object on every rank.

        Each rank sends its parts directly to every other rank (each rank
        sends and receives p-1 copies, as a ring would, without its p-1 steps).

        Args:
            obj: a picklable object.
            async_op: return a Work (whose result() is the list) instead of waiting.

        Returns:
            The list of every rank's object (unpickled copies, this rank's own included).

        Raises:
            TcollError: another rank could not pickle its object (that rank raises the pickling error).
        """
        parts, error = _try_dump(obj)
        team = self._team()

        def body() -> Algorithm:
            peers = [(team.rank + k) % team.size for k in range(1, team.size)]
            received = yield from _exchange(team, {peer: parts for peer in peers}, peers)
            if error is not None:
                raise error
            _check_failed("all_gather_object", received)
            received[team.rank] = parts
            return [(_copy_load if r == team.rank else load)(received[r]) for r in range(team.size)]

        return self._run_objects(team, "all_gather_object", body(), async_op)

    def gather_object(self, obj: Any, root: int = 0, *, async_op: bool = False) -> Any:
        """Gather every rank's object on `root`.

        Args:
            obj: a picklable object.
            root: the rank that gets the objects.
            async_op: return a Work (whose result() is the list or None) instead of waiting.

        Returns:
            On root, the list of every rank's object (unpickled copies); None elsewhere.

        Raises:
            ValueError: root out of range.
            TcollError: (on root) a rank could not pickle its object (that rank raises the pickling error).
        """
        self._check_root(root)
        parts, error = _try_dump(obj)
        team = self._team()

        def body() -> Algorithm:
            if team.rank != root:
                yield from _exchange(team, {root: parts}, [])
                if error is not None:
                    raise error
                return None
            others = [r for r in range(team.size) if r != root]
            received = yield from _exchange(team, {}, others)
            if error is not None:
                raise error
            _check_failed("gather_object", received)
            return [_copy_load(parts or []) if r == root else load(received[r] or []) for r in range(team.size)]

        return self._run_objects(team, "gather_object", body(), async_op)

    def scatter_object(self, objs: Sequence[Any] | None, root: int = 0, *, async_op: bool = False) -> Any:
        """Send objs[r] of `root` to rank r.

        Args:
            objs: on root, a list of `size` picklable objects; ignored elsewhere.
            root: the rank that holds the objects.
            async_op: return a Work (whose result() is the object) instead of waiting.

        Returns:
            This rank's object (an unpickled copy, on root too).

        Raises:
            ValueError: root out of range; (on root) objs is not a list of `size` objects.
            TcollError: (off root) root could not pickle this rank's object; root raises the pickling error.
        """
        self._check_root(root)
        outgoing: dict[int, Parts | None] = {}
        error: BaseException | None = None
        if self.rank == root:
            if not isinstance(objs, (list, tuple)):
                raise ValueError(f"scatter_object needs a list of {self.size} objects on the root, one per rank; "
                                 f"got {type(objs).__name__}")
            if len(objs) != self.size:
                raise ValueError(f"scatter_object needs {self.size} objects on the root, one per rank; "
                                 f"got {len(objs)}")
            for r in range(self.size):
                outgoing[r], failure = _try_dump(objs[r])
                error = error or failure
        team = self._team()

        def body() -> Algorithm:
            if team.rank == root:
                mine = outgoing.pop(root)
                yield from _exchange(team, outgoing, [])
                if error is not None:
                    raise error
                return _copy_load(mine or [])
            received = yield from _exchange(team, {}, [root])
            _check_failed("scatter_object", received)
            return load(received[root] or [])

        return self._run_objects(team, "scatter_object", body(), async_op)

    # -- point-to-point ------------------------------------------------------------

    def send_object(self, obj: Any, dst: int, tag: int = 0) -> None:
        """Send the object `obj` to rank `dst`, to be received by recv_object(src, tag).

        Messages on (dst, tag): an int64 size record (and, for more than seven
        parts, the remaining sizes), then the pickle stream and each large
        buffer straight from memory. Other sends from this rank on the same
        (dst, tag) must not run concurrently (from another thread), or the
        messages interleave.

        Args:
            obj: a picklable object.
            dst: the destination rank.
            tag: a non-negative integer that recv_object must name too.

        Raises:
            ValueError: dst out of range or bad tag.
            pickle.PicklingError, TypeError, ...: obj cannot be pickled (nothing is sent).
        """
        self._check_peer(dst, "dst")
        self._check_tag(tag)
        parts = dump(obj)
        record, overflow = _record(parts)
        works = [self.isend(record, dst, tag)]
        if overflow.size:
            works.append(self.isend(overflow, dst, tag))
        works += [self.isend(part, dst, tag) for part in parts]
        for work in works:
            work.wait()

    def recv_object(self, src: int, tag: int = 0) -> Any:
        """Receive an object that rank `src` sent with send_object(obj, dst, tag).

        Security: the object is unpickled (see the module docstring).

        Args:
            src: the source rank.
            tag: the tag the sender used.

        Returns:
            The unpickled object.

        Raises:
            ValueError: src out of range or bad tag.
            MismatchError: the message on (src, tag) was not sent by send_object.
        """
        record = np.zeros(_SLOTS + 1, dtype=np.int64)
        self._recv_exact([record], src, tag)
        if record[0] < 1:
            raise MismatchError(f"recv_object from rank {src} (tag {tag}): the message is not an object's")
        overflow = _overflow_for(record)
        if overflow.size:
            self._recv_exact([overflow], src, tag)
        parts = _allocate(record, overflow) or []
        self._recv_exact(parts, src, tag)
        return load(parts)

    def _recv_exact(self, bufs: list[np.ndarray], src: int, tag: int) -> None:
        """Receive one message into each of `bufs`, in order; each must fill its buffer exactly."""
        works = [cast(RecvWork, self.irecv(buf, src, tag)) for buf in bufs]
        try:
            for work, buf in zip(works, bufs):
                work.wait()
                if work.nbytes != buf.nbytes:
                    raise MismatchError(f"recv_object from rank {src} (tag {tag}): a message of {work.nbytes} "
                                        f"bytes arrived where {buf.nbytes} were expected; was it sent by send_object?")
        except BaseException:
            for work in works:
                if not work.done():
                    self._engine.cancel(work)
            raise
