"""MPI transport: point-to-point messages through mpi4py's non-blocking Isend/Irecv, under tcoll's own matching.

Chosen by TCOLL_TRANSPORT=mpi (every pair) or TCOLL_INTERHOST=mpi (pairs on
different hosts; shared memory stays in charge inside a host). It needs the
optional extra `tcoll[mpi]` (mpi4py and an MPI library) and a job started by
mpiexec, whose ranks are tcoll's ranks.

MPI carries bytes only; tcoll's engine keeps its own rules. Every message is
two MPI messages on a private duplicate of MPI_COMM_WORLD: its 40-byte tcoll
header (context, tag, size and the call's stamp, `p2p/channel.py`) on MPI tag
1, then its payload on MPI tag 2 (a payload of up to 8 KiB rides in the
header's message instead). A channel keeps one header receive posted
per peer; when a header arrives it asks the engine which receive it belongs
to, exactly as the TCP channel does, and only then posts the payload's
receive straight into that buffer. MPI keeps messages of one tag between two
ranks in order, so the k-th payload receive gets the k-th payload. Matching,
wildcards, timeouts, stamps and mismatch checks are therefore the engine's,
unchanged. MPI has no file descriptor to sleep on, so a rank with MPI
channels polls while it waits, as MPI libraries do.
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import PeerLostError, TransportError
from ..p2p.channel import HEADER, Channel, pack_header, unpack_header
from .base import Card, Transport
from .shm.channel import process_alive

if TYPE_CHECKING:
    from ..p2p.work import RecvWork, SendWork, Work
    from ..store import Store

__all__ = ["MpiTransport", "MpiChannel", "mpi_module"]

_HDR_TAG, _DATA_TAG = 1, 2
_HDR = HEADER.size
_INLINE = 8 << 10  # payloads up to this size travel in the header's message: one MPI message, not two


def mpi_module() -> Any:
    """mpi4py's MPI module (initialising MPI), or None when mpi4py is not installed."""
    try:
        from mpi4py import MPI
    except ImportError:
        return None
    return MPI


class MpiChannel(Channel):
    """Messages to and from one peer through MPI requests (see the module docstring).

    Args:
        engine: the engine to report to.
        peer: the peer's tcoll world rank.
        comm: the transport's MPI communicator.
        mpi_rank: the peer's rank in `comm`.
    """

    transport_name = "mpi"

    def __init__(self, engine: Any, peer: int, comm: Any, mpi_rank: int,
                 process: tuple[int, int | None] | None = None) -> None:
        super().__init__(engine, peer)
        self._process = process  # (pid, start time) of a peer this rank can see in /proc, else None
        MPI = mpi_module()
        self._byte = MPI.BYTE
        self._testall = MPI.Request.Testall
        self._comm = comm
        self._dest = mpi_rank
        self._sends: deque[tuple[SendWork, list[Any], bytes]] = deque()  # header kept alive until sent
        self._hdr = np.empty(_HDR + _INLINE, dtype=np.uint8)
        self._hdr_req = comm.Irecv([self._hdr, _HDR + _INLINE, self._byte], source=mpi_rank, tag=_HDR_TAG)
        self._pending: tuple[int, int, int, int] | None = None
        self._receiving: deque[tuple[RecvWork, Any, Any]] = deque()  # (work, request, scratch kept alive)
        self.closed = False

    def post(self, send: SendWork) -> None:
        """Start the header's and the payload's MPI sends at once (MPI orders them)."""
        head = pack_header(send.ctx, send.tag, send.nbytes, send.stamp)
        if send.nbytes <= _INLINE:
            head += send.data[:send.nbytes].tobytes()
        requests = [self._comm.Isend([head, len(head), self._byte], dest=self._dest, tag=_HDR_TAG)]
        if send.nbytes > _INLINE:
            requests.append(self._comm.Isend([send.data, send.nbytes, self._byte], dest=self._dest, tag=_DATA_TAG))
        self._sends.append((send, requests, head))

    def progress(self) -> bool:
        """Complete finished sends, take arrived headers, complete finished payload receives.

        Raises:
            PeerLostError: MPI reported an error on this peer's requests.
        """
        try:
            moved = self._finish_sends()
            while self._take_header():
                moved = True
            while self._receiving and (self._receiving[0][1] is None or self._receiving[0][1].Test()):
                work, _, _ = self._receiving.popleft()
                work.offset = work.nbytes
                self.engine.recv_done(work)
                moved = True
            return moved
        except _MPI_ERRORS as exc:  # an MPI error on this pair: the peer is as good as lost
            raise PeerLostError(self.peer, f"MPI error: {exc}") from None

    def _finish_sends(self) -> bool:
        moved = False
        while self._sends:
            send, requests, _ = self._sends[0]
            if not self._testall(requests):
                break
            self._sends.popleft()
            send.offset = send.nbytes
            self.engine.send_done(send)
            moved = True
        return moved

    def _take_header(self) -> bool:
        """Decode an arrived header and, once the engine has its receive, post the payload's receive."""
        if self._pending is None:
            if not self._hdr_req.Test():
                return False
            try:
                self._pending = unpack_header(self._hdr[:_HDR].tobytes(), self.peer)
            except TransportError as exc:
                raise PeerLostError(self.peer, str(exc)) from None
        ctx, tag, nbytes, stamp = self._pending
        target = self.engine.match(self.peer, ctx, tag, nbytes, stamp)
        if target is None:
            return False  # no receive for it yet: asked again on the next progress
        self._pending = None
        request = None  # an inline payload is complete now, but reported in order after earlier ones
        if nbytes <= _INLINE:
            if target.data is not None:  # None: too large for its receive, dropped as TCP does
                target.data[:nbytes] = self._hdr[_HDR:_HDR + nbytes]
            buf = None
        else:
            buf = np.empty(nbytes, dtype=np.uint8) if target.data is None else target.data[:nbytes]
            request = self._comm.Irecv([buf, nbytes, self._byte], source=self._dest, tag=_DATA_TAG)
        self._hdr_req = self._comm.Irecv([self._hdr, _HDR + _INLINE, self._byte], source=self._dest, tag=_HDR_TAG)
        self._receiving.append((target, request, buf))
        return True

    def check_alive(self) -> None:
        """Raise PeerLostError if the peer's process is gone (peers on this host only: MPI says nothing of it)."""
        if self._process is not None and not self.closed and not process_alive(*self._process):
            raise PeerLostError(self.peer, f"process {self._process[0]} on this host is gone")

    def pending_works(self) -> list[Work]:
        """The sends not yet complete and the receives being filled."""
        return [send for send, _, _ in self._sends] + [work for work, _, _ in self._receiving]

    def close(self) -> None:
        """Cancel the posted header receive (idempotent); MPI frees the rest with its communicator."""
        if self.closed:
            return
        self.closed = True
        try:
            self._hdr_req.Cancel()
            self._hdr_req.Wait()
        except _MPI_ERRORS:
            pass


class MpiTransport(Transport):
    """MPI channels between ranks of one mpiexec job (see the module docstring)."""

    name = "mpi"

    def __init__(self, engine: Any, settings: Any, run_id: str, master_host: str | None = None) -> None:
        super().__init__(engine, settings, run_id, master_host)
        self._comm: Any = None
        self._channels: list[MpiChannel] = []

    @classmethod
    def available(cls) -> bool:
        """Whether mpi4py can be imported (the extra `tcoll[mpi]`)."""
        try:
            import mpi4py  # noqa: F401 - only asks whether it is installed; MPI starts in prepare()
        except ImportError:
            return False
        return True

    def can_connect(self, me: Card, peer: Card) -> bool:
        """Both ranks are in the same MPI job (the job token rank 0 of MPI_COMM_WORLD drew)."""
        return "mpi" in peer and "mpi" in me and peer["mpi"]["job"] == me["mpi"]["job"]

    def prepare(self) -> dict[str, Any]:
        """Start MPI, duplicate MPI_COMM_WORLD (collective over the MPI job) and draw the job's token."""
        MPI = mpi_module()
        if MPI is None:
            raise TransportError("TCOLL_TRANSPORT=mpi needs mpi4py: pip install 'tcoll[mpi]'")
        global _MPI_ERRORS
        _MPI_ERRORS = (MPI.Exception,)
        self._comm = MPI.COMM_WORLD.Dup()
        import secrets

        job = self._comm.bcast(secrets.token_hex(8) if self._comm.Get_rank() == 0 else None, root=0)
        return {"rank": self._comm.Get_rank(), "size": self._comm.Get_size(), "job": job}

    def connect(self, peers: list[int], cards: list[Card], store: Store, timeout: float) -> dict[int, Channel]:
        """A channel per peer; nothing to dial: MPI already connects the job's ranks."""
        channels: dict[int, Channel] = {}
        me = cards[self.engine.rank]
        for peer in peers:
            card = cards[peer]
            seen = (card.get("host") == me.get("host") and card.get("pidns") == me.get("pidns") and card.get("pidns")
                    and card.get("pid"))
            process = (int(card["pid"]), card.get("start_time")) if seen else None
            channel = MpiChannel(self.engine, peer, self._comm, card["mpi"]["rank"], process)
            self._channels.append(channel)
            channels[peer] = channel
        if channels:
            self.engine.poll_only = True  # no descriptor wakes a sleeping rank for MPI traffic
        return channels

    def close(self) -> None:
        """Close the channels and free the duplicated communicator (MPI itself ends at exit)."""
        for channel in self._channels:
            channel.close()
        self._channels.clear()
        if self._comm is not None:
            try:
                self._comm.Free()
            except _MPI_ERRORS:
                pass
            self._comm = None


_MPI_ERRORS: tuple[type[BaseException], ...] = (RuntimeError,)
