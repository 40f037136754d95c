"""recv from any source for the torch backend: tcoll has no any-source receive, so it is built here.

One receive is posted from every peer; the first to complete wins, the
others are withdrawn, and a message that already matched one of them is kept
(the group's stash) and handed to the next receive from its rank. A receive
from that rank and tag posted before then would get the following message
first: the one ordering an any-source receive can disturb.
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING, Any

import torch

from ..comm.communicator import Communicator
from ..errors import PeerLostError
from ..errors import TimeoutError as TcollTimeout
from ..p2p.work import wait_any
from .tensors import Contiguous, copy_message

if TYPE_CHECKING:
    from .process_group import ProcessGroupTcoll
    from .work import TcollWork

__all__ = ["AnySource", "FirstOf"]


class AnySource:
    """recv_anysource: a receive posted from every peer; the first message wins (see recv_anysource)."""

    def __init__(self, pg: ProcessGroupTcoll, tensor: torch.Tensor, tag: int) -> None:
        self.pg, self.tensor, self.tag = pg, tensor, tag
        self.out = Contiguous(tensor, copy_in=False)
        self.nbytes = self.out.work.numel() * self.out.work.element_size()

    def work(self) -> TcollWork:
        pg = self.pg
        for peer in range(pg.comm.size):
            stashed = pg._stash.get((peer, self.tag))
            if stashed:
                data = stashed.popleft()
                return pg._p2p([self.tensor], [], lambda: copy_message(self.out, data), source=peer)
        buffers: dict[int, torch.Tensor] = {}
        receives: dict[int, Any] = {}
        lost: PeerLostError | None = None
        for peer in range(pg.comm.size):
            if peer == pg.comm.rank:
                continue
            buffers[peer] = torch.empty(self.nbytes, dtype=torch.uint8)
            try:
                receives[peer] = pg.comm.irecv(buffers[peer].numpy(), peer, self.tag)
            except PeerLostError as exc:  # a rank known to be gone sends nothing more; the others may
                lost = exc
        if not receives and lost is not None:
            raise lost
        result = pg._p2p([self.tensor], [FirstOf(pg.comm, receives)], None)
        result._finish = lambda: self._settle(result, receives, buffers)
        return result

    def _settle(self, result: TcollWork, receives: dict[int, Any], buffers: dict[int, torch.Tensor]) -> None:
        """Keep the winner's message, withdraw the other receives, stash what already matched."""
        comm = self.pg.comm
        finished = [p for p, w in receives.items() if w.done()]
        succeeded = [p for p in finished if receives[p].exception() is None]
        winner = min(succeeded or finished)  # a live sender beats a peer that was lost meanwhile
        for peer, work in receives.items():
            if peer == winner or work.cancel():
                continue
            try:
                work.wait(comm.timeout)
            except PeerLostError:  # that rank is gone; its error is not this receive's
                continue
            self.pg._stash.setdefault((peer, self.tag), deque()).append(buffers[peer][:work.nbytes].clone())
        receives[winner].wait(0)
        copy_message(self.out, buffers[winner][:receives[winner].nbytes])
        result._source = winner


class FirstOf:
    """A waitable that completes when the first of several tcoll Works has (for recv_anysource)."""

    def __init__(self, comm: Communicator, works: dict[int, Any]) -> None:
        self.comm, self.works = comm, works

    def done(self) -> bool:
        return any(w.done() for w in self.works.values())

    def exception(self) -> BaseException | None:
        return None

    def wait(self, timeout: float | None = None) -> None:
        limit = self.comm.timeout if timeout is None else timeout
        try:
            wait_any(list(self.works.values()), limit)
        except TcollTimeout:
            raise TcollTimeout(f"recv from any rank did not complete within {limit:g} s", list(self.works)) from None

    def abort(self, error: BaseException) -> None:
        for work in self.works.values():
            work.cancel()
