"""The shared-memory channel: both directions between this rank and one peer on the same host.

The writer copies a message into the peer's inbound ring (tcoll.transport.shm.rings) and rings the
reader's doorbell; the reader copies it out and rings the writer's (it may wait for space). A doorbell
only costs a system call when its owner sleeps. A large payload flows through the ring in chunks, so
the writer copies chunk k+1 in while the reader copies chunk k out (pipelining), and what the reader
reads was written moments ago and is still in cache. Blocking calls that need no queue take the lean
path: one C call of the ring kernel (`_ring_kernel.c`) per message.
"""

from __future__ import annotations

import os
from collections import deque
from typing import Any

from ...errors import PeerLostError
from ...p2p.channel import HEADER, MAGIC, Channel, pack_header, unpack_header
from ...p2p.work import RecvWork, SendWork, Work
from ...p2p.waiting import Doorbell
from ..base import Card
from .rings import HEAD, TAIL, Ring, read, read_header, ring_kernel, write

__all__ = ["ShmChannel", "process_alive"]

_WORD = (1 << 64) - 1


def process_alive(pid: int, start_time: int | None) -> bool:
    """Whether process `pid` (started at `start_time` clock ticks) still runs (Linux /proc).

    Only a definite answer is death: no such process (ENOENT, ESRCH), a zombie, or
    another start time (the pid was reused). A look that fails for any other
    reason (this rank is out of file descriptors, EMFILE or ENFILE; no permission)
    says nothing about the peer, so it counts as alive: a stranger who makes this
    rank run out of descriptors must not make it declare a live peer dead.
    """
    try:
        with open(f"/proc/{pid}/stat", "rb") as handle:
            stat = handle.read()
    except (FileNotFoundError, ProcessLookupError):
        return False
    except OSError:
        return True  # no answer: look again later
    fields = stat.rpartition(b")")[2].split()
    state = fields[0]
    if state in (b"Z", b"X", b"x"):
        return False
    return start_time is None or int(fields[19]) == start_time


class ShmChannel(Channel):
    """Both directions between this rank and one peer on the same host."""

    transport_name = "shm"

    def __init__(self, engine: Any, peer: int, inbound: Ring, outbound: Ring, peer_bell: Doorbell,
                 peer_closed: memoryview, peer_card: Card, chunk: int) -> None:
        super().__init__(engine, peer)
        self._in = inbound
        self._out = outbound
        self._peer_bell = peer_bell
        self._peer_closed = peer_closed
        self._chunk = min(chunk, outbound.size // 2)
        self._sends: deque[SendWork] = deque()
        # The stream positions live only in the rings' control words (we are the only writer of the outbound
        # head and of the inbound tail): the lean path's C calls publish them, and no copy here can fall
        # behind when an exception lands between such a call and the next statement.
        self._header: tuple[int, int, int, int] | None = None  # a header whose receive is not posted yet
        self._recv: RecvWork | None = None
        self._pid = int(peer_card.get("pid", 0))
        self._start_time = peer_card.get("start_time")
        self._same_pidns = peer_card.get("pidns") == _pid_namespace()
        self._closed = False
        self._rings = None
        if ring_kernel is not None and engine.settings.shm_kernel != "off":
            self._rings = ring_kernel.Rings(inbound.ctl, inbound.mv, outbound.ctl, outbound.mv, peer_bell.memory)

    @property
    def lean(self) -> bool:
        """Whether the ring kernel serves this channel's blocking calls (built, and TCOLL_SHM_KERNEL not off)."""
        return self._rings is not None

    # -- the lean blocking path (engine lock held) ---------------------------------

    def send_now(self, ctx: int, tag: int, buf: Any) -> bool:
        """Write a user message whole into the peer's ring, if nothing is queued before it and it fits now."""
        rings = self._rings
        if rings is None or self._sends:
            return False
        return rings.send(ctx, tag, buf) >= 0

    def recv_now(self, ctx: int, tag: int, buf: Any, spin_ns: int, yields: bool) -> bool:
        """Take the next message of our ring into `buf` if it is (ctx, tag), fits, and comes within the spin."""
        rings = self._rings
        if rings is None or self._recv is not None or self._header is not None:
            return False
        return rings.recv(ctx, tag, buf, spin_ns, yields) >= 0

    # -- outbound --------------------------------------------------------------

    def post(self, send: SendWork) -> None:
        self._sends.append(send)
        if len(self._sends) == 1:
            self._push()

    def _push(self) -> bool:
        """Copy queued sends into the peer's ring, as far as space allows."""
        ring = self._out
        size = ring.size
        head = ring.ctl[HEAD]
        budget = size  # then let the inbound direction have its turn
        moved = False
        sends = self._sends
        while sends and budget > 0:
            send = sends[0]
            free = size - (head - ring.ctl[TAIL])
            if free < (1 if send.header_sent else HEADER.size):
                break
            if not send.header_sent:
                at = head % size
                stamp = send.stamp
                if at + HEADER.size <= size:
                    HEADER.pack_into(ring.mv, at, MAGIC, send.ctx, send.tag, send.nbytes, stamp & _WORD, stamp >> 64)
                else:
                    write(ring, head, pack_header(send.ctx, send.tag, send.nbytes, stamp))
                head += HEADER.size
                free -= HEADER.size
                send.header_sent = True
            count = min(free, send.nbytes - send.offset, self._chunk)
            if count:
                write(ring, head, send.data, send.offset, count)
                head += count
                send.offset += count
                budget -= count
            ring.ctl[HEAD] = head
            self._peer_bell.ring()
            moved = True
            if send.offset == send.nbytes:
                sends.popleft()
                self.engine.send_done(send)
        return moved

    # -- inbound ---------------------------------------------------------------

    def _pull(self) -> bool:
        """Copy arrived bytes out of our ring into the receives they belong to."""
        ring = self._in
        tail = ring.ctl[TAIL]
        head = ring.ctl[HEAD]
        budget = ring.size
        moved = False
        while budget > 0:
            recv = self._recv
            if recv is None:
                if self._header is None:
                    if head - tail < HEADER.size:
                        break
                    self._header = unpack_header(read_header(ring, tail), self.peer)
                    tail += HEADER.size
                    moved = True
                ctx, tag, nbytes, stamp = self._header
                recv = self.engine.match(self.peer, ctx, tag, nbytes, stamp)
                if recv is None:
                    break  # a large message nobody asked for yet: leave it in the ring
                self._header = None
                self._recv = recv
            count = min(head - tail, recv.nbytes - recv.offset, self._chunk)
            if count:
                if recv.data is not None:
                    read(ring, tail, recv.data, recv.offset, count)
                tail += count
                recv.offset += count
                budget -= count
                moved = True
            if recv.offset == recv.nbytes:
                self._recv = None
                self._publish_tail(tail)
                self.engine.recv_done(recv)
            elif not count:
                head = ring.ctl[HEAD]
                if head - tail == 0:
                    break
            else:
                self._publish_tail(tail)
        if tail != ring.ctl[TAIL]:
            self._publish_tail(tail)
        return moved

    def _publish_tail(self, tail: int) -> None:
        ctl = self._in.ctl
        if tail != ctl[TAIL]:
            ctl[TAIL] = tail
            self._peer_bell.ring()

    # -- Channel interface -------------------------------------------------------

    def progress(self) -> bool:
        if self._closed:
            return False
        moved = self._pull()
        if self._sends and self._push():
            moved = True
        if not moved and self._peer_closed[0] and (self._sends or self._recv or self.engine.expects_from(self.peer)):
            raise PeerLostError(self.peer, "it closed its communicator")
        return moved

    def pending_works(self) -> list[Work]:
        pending: list[Work] = list(self._sends)
        if self._recv is not None:
            pending.append(self._recv)
        return pending

    def peer_doorbell(self) -> Doorbell | None:
        return None if self._closed else self._peer_bell

    def check_alive(self) -> None:
        if self._peer_closed[0]:
            raise PeerLostError(self.peer, "it closed its communicator")
        if self._same_pidns and self._pid and not process_alive(self._pid, self._start_time):
            raise PeerLostError(self.peer, f"process {self._pid} on this host is gone")

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._sends.clear()
        self._rings = None  # its exports of the rings go with it (the engine's lock keeps calls out meanwhile)
        self._in.release()
        self._out.release()
        self._peer_bell.wake()  # a peer blocked on us looks again, and finds us closed
        self._peer_bell.release()
        self._peer_closed.release()


def _pid_namespace() -> str:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""
