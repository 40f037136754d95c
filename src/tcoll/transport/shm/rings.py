"""The rings of the shared-memory transport: their layout in a rank's segment and the copies in and out.

Each rank owns one segment: a control page (its doorbell, then its "closed"
word) and one ring per local peer, the *inbound* ring that peer writes into.
A ring is a byte stream with two counters on separate cache lines: `head`
(bytes written, only the writer stores it) and `tail` (bytes read, only the
reader stores it), so no atomic read-modify-write is needed. A message is a
40-byte header (tcoll.p2p.channel) followed by its payload, wrapping at the
end of the ring.

The lean blocking send and receive (`_ring_kernel.c`) write and read the same
rings in C; `check_ring_kernel` refuses a kernel built with another wire format.
"""

from __future__ import annotations

import mmap
from typing import Any

import numpy as np

from ...native import check_exports
from ...p2p.channel import HEADER, MAGIC

try:  # the lean blocking send and receive in C (_ring_kernel.c), built with the package where a compiler is
    from . import _ring_kernel as ring_kernel
except ImportError:  # pragma: no cover - installed without a compiler: blocking calls go through the engine
    ring_kernel = None  # type: ignore[assignment]

__all__ = ["Ring", "ring_bytes", "write", "read", "read_header", "check_ring_kernel", "ring_kernel", "CONTROL",
           "CLOSED_AT", "RING_CTL", "HEAD", "TAIL"]


def check_ring_kernel(module: Any) -> None:
    """Refuse a built ring kernel whose wire format differs from tcoll.p2p.channel's (a stale or edited build).

    The kernel writes and reads whole messages, header included: a different magic
    or header size would corrupt the stream that the Python channel reads.

    Args:
        module: the kernel extension, or None (not built: nothing to compare).

    Raises:
        ImportError: naming every constant that differs.
    """
    check_exports(module, {"MAGIC": MAGIC, "HEADER_BYTES": HEADER.size}, "tcoll.p2p.channel",
                  "the wire format it writes")


check_ring_kernel(ring_kernel)

CONTROL = 4096  # first page: the owner's doorbell, then its "closed" word
CLOSED_AT = 64  # byte offset of the uint32 set when the owner closes its communicator
RING_CTL = 128  # head on the first cache line, tail on the second
HEAD, TAIL = 0, 8  # indexes into the control words, viewed as uint64
_SMALL = 4096  # copies below this go through memoryview (less overhead than NumPy)
_TOTAL_BUDGET = 256 << 20  # default bytes of rings per host, split among the pairs


class Ring:
    """One ring in a mapped segment: control words, and the data area as memoryview and array."""

    __slots__ = ("ctl", "mv", "np", "size")

    def __init__(self, buf: mmap.mmap, offset: int, size: int) -> None:
        self.ctl = memoryview(buf)[offset:offset + RING_CTL].cast("Q")
        self.mv = memoryview(buf)[offset + RING_CTL:offset + RING_CTL + size]
        self.np = np.frombuffer(buf, dtype=np.uint8, count=size, offset=offset + RING_CTL)
        self.size = size

    def release(self) -> None:
        """Let go of the ring's views. One still exported elsewhere for a moment (a frame the hang
        reporter is sampling holds the locals of a call that used them) goes with its last user, as a
        segment's mapping does (Segment.close)."""
        for view in (self.ctl, self.mv):
            try:
                view.release()
            except BufferError:
                pass
        self.np = None  # type: ignore[assignment]  # drops its export of the mapping


def ring_bytes(settings_ring: int, nlocal: int) -> int:
    """The ring size: the setting, or the host budget split among the ordered pairs."""
    if settings_ring:
        return (settings_ring + 4095) & ~4095  # keeps every ring's counters 8-byte aligned
    pairs = max(1, nlocal * (nlocal - 1))
    size = min(4 << 20, max(256 << 10, _TOTAL_BUDGET // pairs))
    return size & ~4095


def write(ring: Ring, pos: int, src: Any, start: int = 0, count: int | None = None) -> None:
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


def read(ring: Ring, pos: int, dst: np.ndarray, start: int, count: int) -> None:
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


def read_header(ring: Ring, pos: int) -> bytes | memoryview:
    """The message header at stream position `pos` (a copy where the end of the ring cuts it)."""
    at = pos % ring.size
    if at + HEADER.size <= ring.size:
        return ring.mv[at:at + HEADER.size]
    return bytes(ring.mv[at:]) + bytes(ring.mv[:HEADER.size - (ring.size - at)])
