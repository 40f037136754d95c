"""Point-to-point of Python objects: send_object, recv_object, isend_object, irecv_object, sendrecv_object.

An object travels as its pickle in parts (tcoll.comm.pickling). The size
record goes on the communicator's point-to-point context with the user's
tag, so it is matched like any message: in order per source and tag, by
ANY_SOURCE / ANY_TAG receives, and seen by probe. The overflow sizes and the
parts follow on a context of their own (the point-to-point one with bit 31
set), with the same tag, from the same source: once a receive has its
record it knows the source, and takes that source's parts in the order they
were sent, so objects in flight on one (source, tag) never mix, however
many there are.

Security: the objects are unpickled (see tcoll.comm.objects).
"""

from __future__ import annotations

import weakref
from collections import deque
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import MismatchError
from ..p2p.work import GroupWork, RecvWork, Work
from .checks import check_peer, check_tag
from .pairs import source_of
from .pickling import SLOTS, allocate, dump, load, overflow_for, size_record

if TYPE_CHECKING:
    from .communicator import Communicator

__all__ = ["send_object", "recv_object", "isend_object", "irecv_object", "sendrecv_object", "ObjectRecvWork",
           "parts_context"]

_PARTS = 1 << 31  # context bit of an object's parts (parts_context)


def parts_context(ctx: int) -> int:
    """The context on which the objects sent on point-to-point context `ctx` carry their parts."""
    return ctx | _PARTS


# Per engine, per (source, context, tag): the object receives that have their record, in the order the
# records came; only the first posts its receives at a time, so each takes its own object's parts.
_lines: weakref.WeakKeyDictionary[Any, dict[tuple[int, int, int], deque[ObjectRecvWork]]] = \
    weakref.WeakKeyDictionary()


def isend_object(comm: Communicator, obj: Any, dst: int, tag: int = 0) -> Work:
    """Start sending the object `obj` to rank `dst`; returns a Work (result() is None once sent).

    The object's arrays must not change until the Work completes.

    Args:
        obj: a picklable object.
        dst: the destination rank.
        tag: a non-negative integer that the receive must name too (or receive with ANY_TAG).

    Raises:
        ValueError: dst out of range or bad tag.
        pickle.PicklingError, TypeError, ...: obj cannot be pickled (nothing is sent).
    """
    comm.core.check_open()
    check_peer(dst, comm.size, "dst")
    check_tag(tag)
    parts = dump(obj)
    record, overflow = size_record(parts)
    engine, peer, ctx = comm.core.engine, comm.core.world[dst], comm.core.p2p_ctx
    works: list[Work] = [engine.isend(record.view(np.uint8), peer, ctx, tag)]
    if overflow.size:
        works.append(engine.isend(overflow.view(np.uint8), peer, parts_context(ctx), tag))
    works += [engine.isend(part, peer, parts_context(ctx), tag, obj) for part in parts]
    return GroupWork(engine, works, None, f"isend_object to rank {dst} (tag {tag})")


def send_object(comm: Communicator, obj: Any, dst: int, tag: int = 0, timeout: float | None = None) -> None:
    """Send the object `obj` to rank `dst`, to be received by recv_object (or irecv_object).

    Args:
        obj: a picklable object.
        dst: the destination rank.
        tag: a non-negative integer that recv_object must name too.
        timeout: seconds to wait (None: the communicator's timeout).

    Raises:
        ValueError: dst out of range or bad tag.
        pickle.PicklingError, TypeError, ...: obj cannot be pickled (nothing is sent).
    """
    isend_object(comm, obj, dst, tag).wait(comm.timeout if timeout is None else timeout)
    if not comm.core.usable:  # revoked while it waited: its peer drained the bytes without receiving them
        comm.core.check_open()


class ObjectRecvWork(Work):
    """The Work of irecv_object: the record, then the overflow sizes, then the parts; result() is the object.

    Once complete, `source` and `tag` tell whose object it is and `nbytes` its size in parts.
    """

    __slots__ = ("_comm", "_record", "_head", "_left", "_parts", "nbytes")

    def __init__(self, comm: Communicator, src: int, tag: int) -> None:
        super().__init__(comm.core.engine, f"irecv_object from rank {src} (tag {tag})")
        self._comm = comm
        self._record = np.zeros(SLOTS + 1, dtype=np.int64)
        self._parts: list[np.ndarray] = []
        self._left = 0
        self.nbytes = -1
        head = comm.core.engine.irecv(self._record.view(np.uint8), source_of(comm, src, tag), comm.core.p2p_ctx, tag)
        head.ranks = comm.core.world
        self._head = head
        head.add_done_callback(self._got_record_locked)

    @property
    def source(self) -> int:
        """The rank that sent the object (-1 until its record has come)."""
        return self._head.source if self._head.peer >= 0 else -1

    @property
    def tag(self) -> int:
        """The tag it was sent with (-1 until its record has come)."""
        return self._head.tag if self._head.peer >= 0 else -1

    def peers(self) -> list[int]:
        return [] if self._done or self._head.peer < 0 else [self._head.peer]

    def cancel(self) -> bool:
        """Withdraw the receive if no object's record has matched it yet."""
        return self._head.cancel()

    def _check(self, work: Work, buf: np.ndarray) -> bool:
        """Whether `work` completed and filled `buf` exactly; else the object receive fails."""
        if self._done:
            return False
        if work.failure is not None:
            self._fail(work.failure)
            return False
        got = work.nbytes  # type: ignore[attr-defined]
        if got != buf.nbytes:
            self._fail(MismatchError(f"{self.description}: a message of {got} bytes arrived where {buf.nbytes} "
                                     "were expected; was it sent by send_object?"))
            return False
        return True

    def _post(self, buf: np.ndarray) -> RecvWork:
        head = self._head
        return self._comm.core.engine.irecv(buf.view(np.uint8), head.peer, parts_context(head.ctx), head.tag)

    def _got_record_locked(self, head: Work) -> None:
        with self._comm.core.engine.lock:  # the record may have come at once, on the user's thread
            self._got_record(head)

    def _got_record(self, head: Work) -> None:
        if not self._check(head, self._record):
            return
        if self._record[0] < 1:
            self._fail(MismatchError(f"{self.description}: the message from rank {self.source} (tag {self.tag}) "
                                     "is not an object's; was it sent by send_object?"))
            return
        line = _lines.setdefault(self._comm.core.engine, {}).setdefault(self._key(), deque())
        line.append(self)
        if len(line) == 1:
            self._take_parts()

    def _key(self) -> tuple[int, int, int]:
        return self._head.peer, self._head.ctx, self._head.tag

    def _take_parts(self) -> None:
        """Post the receives of this object's overflow sizes, then of its parts (first in its line)."""
        overflow = overflow_for(self._record)
        if overflow.size:
            self._post(overflow).add_done_callback(lambda work: self._got_sizes(work, overflow))
        else:
            self._got_sizes(None, overflow)

    def _got_sizes(self, work: Work | None, overflow: np.ndarray) -> None:
        if work is None or self._check(work, overflow):
            self._parts = allocate(self._record, overflow) or []
            self._left = len(self._parts)
            posted = [(self._post(part), part) for part in self._parts]
        else:
            posted = []
        lines = _lines[self._comm.core.engine]
        line = lines[self._key()]
        line.popleft()  # its receives are posted: the next object of this line may post its own
        if line:
            line[0]._take_parts()
        else:
            del lines[self._key()]
        if not self._parts and not self._done:
            self._got_part(None, None)
        for receive, part in posted:
            receive.add_done_callback(lambda done, part=part: self._got_part(done, part))

    def _got_part(self, work: Work | None, part: np.ndarray | None) -> None:
        if work is not None and not self._check(work, part):  # type: ignore[arg-type]
            return
        self._left -= 1
        if self._left <= 0:
            self.nbytes = sum(p.nbytes for p in self._parts)
            try:
                self._finish(load(self._parts))
            except Exception as exc:  # noqa: BLE001 - unpickling can raise anything: the receive's failure
                self._fail(exc)


def irecv_object(comm: Communicator, src: int, tag: int = 0) -> ObjectRecvWork:
    """Start receiving an object sent by send_object or isend_object; result() is the object.

    Args:
        src: the source rank, or ANY_SOURCE.
        tag: the tag the sender used, or ANY_TAG.

    Raises:
        ValueError: src out of range or bad tag.
    """
    comm.core.check_open()
    return ObjectRecvWork(comm, src, tag)


def recv_object(comm: Communicator, src: int, tag: int = 0, timeout: float | None = None) -> Any:
    """Receive an object that rank `src` sent with send_object(obj, dst, tag).

    Args:
        src: the source rank, or ANY_SOURCE.
        tag: the tag the sender used, or ANY_TAG.
        timeout: seconds to wait (None: the communicator's timeout).

    Returns:
        The unpickled object.

    Raises:
        ValueError: src out of range or bad tag.
        MismatchError: the message on (src, tag) was not sent by send_object.
    """
    work = irecv_object(comm, src, tag)
    try:
        return work.wait(comm.timeout if timeout is None else timeout)
    except BaseException:
        work.cancel()  # not matched yet: the object goes to a later receive
        raise


def sendrecv_object(comm: Communicator, obj: Any, dst: int, src: int, sendtag: int = 0, recvtag: int = 0,
                    async_op: bool = False, timeout: float | None = None) -> Any:
    """Send `obj` to `dst` and receive an object from `src`, both at once (never a deadlock).

    Args:
        obj: a picklable object.
        dst: the rank to send to.
        src: the rank to receive from, or ANY_SOURCE.
        sendtag, recvtag: the tags (recvtag may be ANY_TAG).
        async_op: return a Work (result() is the object received).
        timeout: seconds to wait (blocking; None: the communicator's timeout).

    Returns:
        The object received, or the Work.
    """
    check_peer(dst, comm.size, "dst")
    check_tag(sendtag)
    receive = irecv_object(comm, src, recvtag)
    try:
        send = isend_object(comm, obj, dst, sendtag)
    except BaseException:
        receive.cancel()
        raise
    work = GroupWork(comm.core.engine, [receive, send], receive.result,
                     f"sendrecv_object (to rank {dst}, from rank {src})", receive)
    if async_op:
        return work
    try:
        return work.wait(comm.timeout if timeout is None else timeout)
    except BaseException:
        receive.cancel()
        raise
