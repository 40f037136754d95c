"""Point-to-point as MPI users write it: sendrecv, sendrecv_replace, probe and iprobe, and the wildcards.

Methods of Communicator. `ANY_SOURCE` and `ANY_TAG` may stand for the
source and the tag of recv, irecv, recv_object, irecv_object, probe and
iprobe (and the receiving side of the sendrecvs). Matching keeps MPI's
order (tcoll.p2p.matching): messages of one source on one tag match in the
order they were sent, and a wildcard never takes a message that an
earlier-posted specific receive would match. A completed receive's Work
tells the `source`, `tag` and `nbytes` of its message; probe tells the same
of a message not yet received.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import numpy as np

from ..buffers import as_bytes
from ..p2p.matching import ANY
from ..p2p.work import GroupWork, RecvWork, Work
from .checks import check_peer, check_tag

if TYPE_CHECKING:
    from .communicator import Communicator

__all__ = ["ANY_SOURCE", "ANY_TAG", "Status", "source_of", "sendrecv", "sendrecv_replace", "probe", "iprobe"]

ANY_SOURCE = ANY  # recv(..., src=ANY_SOURCE): a message from any rank
ANY_TAG = ANY  # recv(..., tag=ANY_TAG): a message with any tag


@dataclasses.dataclass(frozen=True)
class Status:
    """What probe tells of a message that has arrived and not been received.

    Attributes:
        source: the rank that sent it.
        tag: its tag.
        nbytes: its size in bytes.
    """

    source: int
    tag: int
    nbytes: int


def source_of(comm: Communicator, src: Any, tag: Any) -> int:
    """The engine peer of a receive's (src, tag), wildcards allowed (checked).

    Raises:
        ValueError: src is neither a rank nor ANY_SOURCE; tag neither a tag nor ANY_TAG.
    """
    if not (type(tag) is int and tag == ANY_TAG):
        check_tag(tag)
    if type(src) is int and src == ANY_SOURCE:
        return ANY
    check_peer(src, comm.size, "src")
    return comm.core.world[src]


def sendrecv(comm: Communicator, sendbuf: Any, dst: int, recvbuf: Any, src: int, sendtag: int = 0,
             recvtag: int = 0, async_op: bool = False, timeout: float | None = None) -> Any:
    """Send `sendbuf` to `dst` and receive into `recvbuf` from `src`, both at once: never a deadlock.

    The receive is posted first, then the send; both move on together, so a
    ring of ranks that each sendrecv to the right and from the left finishes
    at any size. The message received may be shorter than recvbuf. A small
    blocking one to a peer on this host is sent at once instead (the lean
    path of `send`), and then received as `recv` does: the receive is posted
    after the send, which is complete by then.

    Args:
        sendbuf: a contiguous buffer (array, tensor) to send.
        dst: the rank to send to.
        recvbuf: a writable contiguous buffer to receive into (not overlapping sendbuf).
        src: the rank to receive from, or ANY_SOURCE.
        sendtag: the tag of the message sent.
        recvtag: the tag of the message to receive, or ANY_TAG.
        async_op: return a Work (result() is recvbuf; source, tag and nbytes tell of the message received).
        timeout: seconds to wait (blocking; None: the communicator's timeout).

    Returns:
        recvbuf, or the Work.

    Raises:
        ValueError, TypeError: bad ranks, tags or buffers (nothing is sent).
        MessageSizeError: the message is longer than recvbuf.
    """
    check_peer(dst, comm.size, "dst")
    check_tag(sendtag)
    source_of(comm, src, recvtag)
    outgoing = as_bytes(sendbuf, writable=False, what="send buffer")  # checked before the receive is posted
    if not async_op and _sent_at_once(comm, outgoing, dst, sendtag, recvbuf):
        return comm.recv(recvbuf, src, recvtag, timeout)  # the send is complete: no deadlock is possible
    recv = comm.irecv(recvbuf, src, recvtag)
    return _pair(comm, recv, _send(comm, recv, sendbuf, dst, sendtag), recvbuf, "sendrecv", async_op, timeout)


def sendrecv_replace(comm: Communicator, buf: Any, dst: int, src: int, sendtag: int = 0, recvtag: int = 0,
                     async_op: bool = False, timeout: float | None = None) -> Any:
    """Send `buf` to `dst` and receive a message from `src` into the same `buf`.

    What is sent is copied first (one copy), so the message received may land while it leaves.

    Args:
        buf: a writable contiguous buffer.
        dst, src, sendtag, recvtag, async_op, timeout: as sendrecv.

    Returns:
        buf, or a Work (result() is buf).
    """
    check_peer(dst, comm.size, "dst")
    check_tag(sendtag)
    source_of(comm, src, recvtag)
    outgoing = np.array(as_bytes(buf, writable=True, what="sendrecv_replace buffer"), copy=True)
    recv = comm.irecv(buf, src, recvtag)
    return _pair(comm, recv, _send(comm, recv, outgoing, dst, sendtag), buf, "sendrecv_replace", async_op, timeout)


def _sent_at_once(comm: Communicator, outgoing: np.ndarray, dst: int, tag: int, recvbuf: Any) -> bool:
    """Send `outgoing` (the send buffer's bytes) through the lean path (a small message to a peer on this
    host, nothing queued before it), once the receive buffer is known to be good: True if sent, complete."""
    if comm.core.engine.lean[comm.core.world[dst]] is None:
        return False
    comm.core.check_open()
    as_bytes(recvbuf, writable=True, what="receive buffer")  # a bad one raises before anything is sent
    return comm.core.engine.send_now(outgoing, comm.core.world[dst], comm.core.p2p_ctx, tag)


def _send(comm: Communicator, recv: Work, buf: Any, dst: int, tag: int) -> Work:
    """Start the send half; if it cannot start (a lost peer), withdraw the receive half first."""
    try:
        return comm.isend(buf, dst, tag)
    except BaseException:
        recv.cancel()
        raise


def _pair(comm: Communicator, recv: Work, send: Work, result: Any, what: str, async_op: bool,
          timeout: float | None) -> Any:
    status = recv if isinstance(recv, RecvWork) else None
    work = GroupWork(comm.core.engine, [recv, send], result, f"{what} ({send.description}; {recv.description})",
                     status)
    if async_op:
        return work
    try:
        return work.wait(comm.timeout if timeout is None else timeout)
    except BaseException:
        recv.cancel()  # not matched yet: the message goes to a later receive
        raise


def probe(comm: Communicator, src: int = ANY_SOURCE, tag: int = ANY_TAG, timeout: float | None = None) -> Status:
    """Wait until a message that recv(src, tag) would take has arrived; tell its source, tag and size.

    The message stays to be received (with a buffer of exactly `nbytes`, say).

    Args:
        src: a rank, or ANY_SOURCE.
        tag: a tag, or ANY_TAG.
        timeout: seconds to wait (None: the communicator's timeout).

    Returns:
        A Status.

    Raises:
        tcoll.TimeoutError: no such message came in time.
    """
    comm.core.check_open()
    peer = source_of(comm, src, tag)
    found = comm.core.engine.probe(peer, comm.core.p2p_ctx, tag, comm.timeout if timeout is None else timeout)
    assert found is not None
    return _status(comm, found)


def iprobe(comm: Communicator, src: int = ANY_SOURCE, tag: int = ANY_TAG) -> Status | None:
    """What probe tells, if such a message has arrived; else None at once."""
    comm.core.check_open()
    peer = source_of(comm, src, tag)
    found = comm.core.engine.probe(peer, comm.core.p2p_ctx, tag)
    return None if found is None else _status(comm, found)


def _status(comm: Communicator, message: RecvWork) -> Status:
    ranks = comm.world_ranks
    return Status(ranks.index(message.peer) if message.peer in ranks else message.peer, message.tag,
                  message.nbytes)
