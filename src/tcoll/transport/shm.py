"""Shared-memory transport for ranks on one host.

Each rank owns one segment in /dev/shm that holds its doorbell and one ring
per local peer: the *inbound* ring that peer writes into. A ring is a byte
stream with two counters on separate cache lines: `head` (bytes written, only
the writer stores it) and `tail` (bytes read, only the reader stores it), so
no atomic read-modify-write is needed. A message is a 40-byte header followed
by its payload; a large payload flows through the ring in chunks, so the
writer copies chunk k+1 in while the reader copies chunk k out (pipelining),
and what the reader reads was written moments ago and is still in cache.

After writing, the writer rings the reader's doorbell; after reading, the
reader rings the writer's (it may wait for space). A doorbell only costs a
system call when its owner sleeps.

Segments are unlinked as soon as every local peer has mapped them, so a
kill -9 after setup leaves nothing in /dev/shm; the launchers also remove
`tcoll-<run id>-*` leftovers of a run that died during setup.
"""

from __future__ import annotations

import json
import mmap
import os
import platform
import secrets
from collections import deque
from typing import Any

import numpy as np

from ..errors import PeerLostError, TransportError
from ..p2p.hosts import host_identity
from ..p2p.channel import HEADER, MAGIC, Channel, pack_header, unpack_header
from ..p2p.waiting import FUTEX_AVAILABLE, Doorbell
from ..p2p.work import RecvWork, SendWork, Work
from ..segments import SHM_DIR, Segment, SegmentGoneError, new_segment, segment_name
from .base import Card, Transport

try:  # the lean blocking send and receive in C (_ring_kernel.c), built with the package where a compiler is
    from . import _ring_kernel as ring_kernel
except ImportError:  # pragma: no cover - installed without a compiler: blocking calls go through the engine
    ring_kernel = None  # type: ignore[assignment]

__all__ = ["ShmTransport", "ShmChannel", "check_ring_kernel", "host_identity", "process_alive", "SHM_DIR",
           "ring_kernel"]


def check_ring_kernel(module: Any) -> None:
    """Refuse a built ring kernel whose wire format differs from tcoll.p2p.channel's (a stale or edited build).

    The kernel writes and reads whole messages, header included: a different magic
    or header size would corrupt the stream that the Python channel reads.

    Args:
        module: the kernel extension, or None (not built: nothing to compare).

    Raises:
        ImportError: naming every constant that differs.
    """
    if module is None:
        return
    ours = {"MAGIC": MAGIC, "HEADER_BYTES": HEADER.size}
    differ = [f"{name} is {getattr(module, name, None)!r} in C but {value!r} in tcoll.p2p.channel"
              for name, value in ours.items() if getattr(module, name, None) != value]
    if differ:
        raise ImportError(f"{module.__name__} ({module.__file__}) does not match the wire format it writes: "
                          f"{'; '.join(differ)}. Rebuild it (pip install ., or build_ext --inplace in a checkout)")


check_ring_kernel(ring_kernel)

_CONTROL = 4096  # first page: the owner's doorbell, then its "closed" word
_CLOSED_AT = 64  # byte offset of the uint32 set when the owner closes its communicator
# The ring protocol relies on stores becoming visible in program order (x86-64
# TSO): payload before head, and the fence in waiting.py ordering a store before
# a later load. Weakly ordered CPUs would need real barriers, which Python lacks.
_ORDERED_MACHINES = ("x86_64", "amd64")
_RING_CTL = 128  # head on the first cache line, tail on the second
_HEAD, _TAIL = 0, 8  # indexes into the control words, viewed as uint64
_SMALL = 4096  # copies below this go through memoryview (less overhead than NumPy)
_TOTAL_BUDGET = 256 << 20  # default bytes of rings per host, split among the pairs
_WORD = (1 << 64) - 1
_HINT = "a smaller TCOLL_SHM_RING, a larger /dev/shm, or TCOLL_TRANSPORT=tcp may help"


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


def _ring_bytes(settings_ring: int, nlocal: int) -> int:
    """The ring size: the setting, or the host budget split among the ordered pairs."""
    if settings_ring:
        return (settings_ring + 4095) & ~4095  # keeps every ring's counters 8-byte aligned
    pairs = max(1, nlocal * (nlocal - 1))
    size = min(4 << 20, max(256 << 10, _TOTAL_BUDGET // pairs))
    return size & ~4095


class _Ring:
    """One ring in a mapped segment: control words, and the data area as memoryview and array."""

    __slots__ = ("ctl", "mv", "np", "size")

    def __init__(self, buf: mmap.mmap, offset: int, size: int) -> None:
        self.ctl = memoryview(buf)[offset:offset + _RING_CTL].cast("Q")
        self.mv = memoryview(buf)[offset + _RING_CTL:offset + _RING_CTL + size]
        self.np = np.frombuffer(buf, dtype=np.uint8, count=size, offset=offset + _RING_CTL)
        self.size = size

    def release(self) -> None:
        self.ctl.release()
        self.mv.release()
        self.np = None  # type: ignore[assignment]  # drops its export of the mapping


class ShmTransport(Transport):
    """Channels through shared memory, for peers on this host."""

    name = "shm"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._own: Segment | None = None
        self._peers: dict[int, Segment] = {}
        self._channels: list[ShmChannel] = []
        self._doorbell: Doorbell | None = None
        self._closed_word: memoryview | None = None

    @classmethod
    def available(cls) -> bool:
        return FUTEX_AVAILABLE and os.path.isdir(SHM_DIR) and platform.machine().lower() in _ORDERED_MACHINES

    def prepare(self) -> dict[str, Any]:
        return {"dir": SHM_DIR}

    def can_connect(self, me: Card, peer: Card) -> bool:
        # Same kernel (boot id) and host name: the peer sees the same /dev/shm.
        return "shm" in peer and peer["host"] == me["host"]

    def connect(self, peers: list[int], cards: list[Card], store: Any, timeout: float) -> dict[int, Channel]:
        if not peers:
            return {}
        me = self.engine.rank
        local = sorted(peers + [me])
        ring = _ring_bytes(self.settings.shm_ring, len(local))
        stride = _RING_CTL + ring
        name = segment_name(self.run_id, me, secrets.token_hex(4))
        # A memfd, which nothing outlives, where every peer can open it through /proc/<our pid>.
        pidns = cards[me].get("pidns")
        anonymous = bool(pidns) and all(cards[peer].get("pidns") == pidns for peer in peers)
        try:
            # One inbound ring per peer, in the order of the peers' ranks.
            self._own = new_segment(name, _CONTROL + stride * len(peers), anonymous=anonymous, hint=_HINT)
            store.set(f"segment/{me}", json.dumps({"path": self._own.path, "name": self._own.name,
                                                    "ring": ring}).encode())
            for peer in peers:
                self._peers[peer] = _open_peer_segment(me, peer, json.loads(store.get(f"segment/{peer}", timeout)),
                                                       ring)
            store.set(f"mapped/{me}", b"1")
            store.wait([f"mapped/{peer}" for peer in peers], timeout)
        finally:
            if self._own is not None:
                self._own.unlink()  # every peer has mapped it (or setup failed): nothing may outlive the job
        self._doorbell = self.engine.doorbell = Doorbell(self._own.map, 0)
        self._closed_word = memoryview(self._own.map)[_CLOSED_AT:_CLOSED_AT + 4].cast("I")
        channels: dict[int, Channel] = {}
        for peer in peers:
            theirs = [rank for rank in local if rank != peer]  # the peer's own peers: all of ours but it
            inbound = _Ring(self._own.map, _CONTROL + stride * peers.index(peer), ring)
            outbound = _Ring(self._peers[peer].map, _CONTROL + stride * theirs.index(me), ring)
            channel = ShmChannel(self.engine, peer, inbound, outbound, Doorbell(self._peers[peer].map, 0),
                                 memoryview(self._peers[peer].map)[_CLOSED_AT:_CLOSED_AT + 4].cast("I"),
                                 cards[peer], self.settings.shm_chunk)
            self._channels.append(channel)
            channels[peer] = channel
        return channels

    def close(self) -> None:
        if self._closed_word is not None:
            self._closed_word[0] = 1  # peers blocked on us see it at once (they are woken below)
            self._closed_word.release()
            self._closed_word = None
        for channel in self._channels:
            channel.close()
        self._channels.clear()
        if self._doorbell is not None:
            self.engine.doorbell = Doorbell.private()
            self._doorbell.release()
            self._doorbell = None
        for segment in self._peers.values():
            segment.close()
        self._peers.clear()
        if self._own is not None:
            self._own.close()
            self._own = None


def _open_peer_segment(me: int, peer: int, published: dict[str, Any], ring: int) -> Segment:
    """Map the rings segment rank `peer` published (its path, memfd name and ring size).

    Raises:
        TransportError: its rings are sized unlike ours; it is gone (the peer
            lets go of it before every rank mapped it only when its own setup
            failed or it died); or it cannot be mapped. Names the rank.
    """
    if published["ring"] != ring:
        raise TransportError(f"rank {peer} sized its shm rings {published['ring']} B, rank {me} {ring} B; "
                             "set TCOLL_SHM_RING alike on every rank")
    path = published["path"]
    try:
        return Segment.open(path, published["name"])
    except SegmentGoneError as exc:
        raise TransportError(f"rank {peer}'s shared memory ({path}) was gone before rank {me} mapped it: rank "
                             f"{peer} stopped meeting the others (it failed or exited; its own error says why): "
                             f"{exc}") from exc
    except TransportError as exc:
        raise TransportError(f"rank {me} cannot map rank {peer}'s shared memory: {exc}") from exc


class ShmChannel(Channel):
    """Both directions between this rank and one peer on the same host."""

    transport_name = "shm"

    def __init__(self, engine: Any, peer: int, inbound: _Ring, outbound: _Ring, peer_bell: Doorbell,
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
        head = ring.ctl[_HEAD]
        budget = size  # then let the inbound direction have its turn
        moved = False
        sends = self._sends
        while sends and budget > 0:
            send = sends[0]
            free = size - (head - ring.ctl[_TAIL])
            if free < (1 if send.header_sent else HEADER.size):
                break
            if not send.header_sent:
                at = head % size
                stamp = send.stamp
                if at + HEADER.size <= size:
                    HEADER.pack_into(ring.mv, at, MAGIC, send.ctx, send.tag, send.nbytes, stamp & _WORD, stamp >> 64)
                else:
                    _write(ring, head, pack_header(send.ctx, send.tag, send.nbytes, stamp))
                head += HEADER.size
                free -= HEADER.size
                send.header_sent = True
            count = min(free, send.nbytes - send.offset, self._chunk)
            if count:
                _write(ring, head, send.data, send.offset, count)
                head += count
                send.offset += count
                budget -= count
            ring.ctl[_HEAD] = head
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
        tail = ring.ctl[_TAIL]
        head = ring.ctl[_HEAD]
        budget = ring.size
        moved = False
        while budget > 0:
            recv = self._recv
            if recv is None:
                if self._header is None:
                    if head - tail < HEADER.size:
                        break
                    self._header = unpack_header(_read_header(ring, tail), self.peer)
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
                    _read(ring, tail, recv.data, recv.offset, count)
                tail += count
                recv.offset += count
                budget -= count
                moved = True
            if recv.offset == recv.nbytes:
                self._recv = None
                self._publish_tail(tail)
                self.engine.recv_done(recv)
            elif not count:
                head = ring.ctl[_HEAD]
                if head - tail == 0:
                    break
            else:
                self._publish_tail(tail)
        if tail != ring.ctl[_TAIL]:
            self._publish_tail(tail)
        return moved

    def _publish_tail(self, tail: int) -> None:
        ctl = self._in.ctl
        if tail != ctl[_TAIL]:
            ctl[_TAIL] = tail
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


def _write(ring: _Ring, pos: int, src: Any, start: int = 0, count: int | None = None) -> None:
    """Copy src[start:start+count] into the ring at stream position `pos`, wrapping at the end."""
    if count is None:
        count = len(src)
    size = ring.size
    at = pos % size
    first = min(count, size - at)
    if count < _SMALL:
        view = src if isinstance(src, bytes) else memoryview(src)
        ring.mv[at:at + first] = view[start:start + first]
        if first < count:
            ring.mv[:count - first] = view[start + first:start + count]
    else:
        ring.np[at:at + first] = src[start:start + first]
        if first < count:
            ring.np[:count - first] = src[start + first:start + count]


def _read(ring: _Ring, pos: int, dst: np.ndarray, start: int, count: int) -> None:
    """Copy `count` bytes at stream position `pos` of the ring into dst[start:]."""
    size = ring.size
    at = pos % size
    first = min(count, size - at)
    if count < _SMALL:
        view = memoryview(dst)
        view[start:start + first] = ring.mv[at:at + first]
        if first < count:
            view[start + first:start + count] = ring.mv[:count - first]
    else:
        dst[start:start + first] = ring.np[at:at + first]
        if first < count:
            dst[start + first:start + count] = ring.np[:count - first]


def _read_header(ring: _Ring, pos: int) -> bytes | memoryview:
    at = pos % ring.size
    if at + HEADER.size <= ring.size:
        return ring.mv[at:at + HEADER.size]
    return bytes(ring.mv[at:]) + bytes(ring.mv[:HEADER.size - (ring.size - at)])
