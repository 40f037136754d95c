"""Build a rank's engine: meet the other ranks, choose a transport per peer, connect.

Transports are tried in order [loopback, shm, mpi, tcp]: each pair of ranks uses
the first one both can use (loopback for threads of one process, shm for
processes of one host, tcp otherwise; mpi instead of tcp with
TCOLL_INTERHOST=mpi). TCOLL_TRANSPORT=shm|tcp|mpi forces one for every pair
(loopback is then off too); a pair the forced transport cannot serve is an
error at startup, not a silent fallback.
"""

from __future__ import annotations

import os
from typing import Any

from ..env import Settings
from ..errors import TransportError
from ..p2p.engine import Engine
from ..p2p.hosts import HostMap, host_identity
from ..p2p.waiting import Doorbell
from ..store.base import Store
from ..transport.base import Card, Transport
from ..transport.loopback import LoopbackTransport
from ..transport.mpi import MpiTransport
from ..transport.shm.transport import ShmTransport
from ..transport.tcp.transport import TcpTransport
from .liveness import PeerWatch, WatchedStore
from .rendezvous import exchange_cards

__all__ = ["connect_world", "TRANSPORTS"]

TRANSPORTS: tuple[type[Transport], ...] = (LoopbackTransport, ShmTransport, MpiTransport, TcpTransport)


def connect_world(store: Store, rank: int, size: int, settings: Settings, run_id: str,
                  master_host: str | None) -> tuple[Engine, list[Transport]]:
    """Connect this rank to every other rank of the world.

    Args:
        store: the rendezvous store shared by all ranks (a fresh prefix per world).
        rank: this rank.
        size: the number of ranks.
        settings: tuning knobs; settings.transport may force one transport.
        run_id: names this job's shared resources (shm segments).
        master_host: the rendezvous host, from which TCP finds its interface.

    Returns:
        The engine, with a channel per peer, and the transports to close with it.

    Raises:
        RendezvousError: a rank did not arrive in time.
        TransportError: a pair of ranks has no usable transport.
    """
    engine = Engine(rank, size, settings, Doorbell.private())
    transports = [cls(engine, settings, run_id, master_host) for cls in _allowed(settings.transport,
                                                                                 settings.interhost)]
    try:
        card = _identity_card(rank)
        watch = PeerWatch(store, rank, size, dict(card))
        watch.publish()
        store = WatchedStore(store, watch)
        for transport in transports:
            transport.peer_check = watch.check
            card[transport.name] = transport.prepare()
        cards = exchange_cards(store, rank, size, card, settings.timeout)
        assignment = _assign(transports, cards, rank, settings.transport)
        for transport in transports:
            peers = assignment[transport.name]
            channels = transport.connect(peers, cards, store.prefix(transport.name), settings.timeout)
            for channel in channels.values():
                engine.add_channel(channel)
        engine.hosts = HostMap([other["host"] for other in cards])
        local = engine.hosts.local_ranks(rank)
        neighbours = [cards[r] for r in local]
        processes = any(other["pid"] != card["pid"] for other in neighbours)
        engine.set_ranks_on_host(len(neighbours), sum(1 for r in local if r < rank), processes)
        # Zero-copy buffers are found through /proc/<pid>: only where every rank of the host sees every pid.
        engine.host_shares_pids = all(other["pidns"] == card["pidns"] and card["pidns"] for other in neighbours)
        if engine.hosts.count > 1:
            engine.link_latency = _agreed_latency(engine, store, rank, size, settings.timeout)
    except BaseException:
        engine.close()
        for transport in transports:
            transport.close()
        raise
    return engine, transports


def _agreed_latency(engine: Engine, store: Store, rank: int, size: int, timeout: float) -> float:
    """Seconds one message takes between hosts: half the largest round trip any rank's kernel measured.

    Every rank publishes the largest smoothed round-trip time of its connections to other hosts
    (the handshakes gave the kernel a few samples); all take the largest, so the cost model's
    choices, which rest on it, are the same on every rank.
    """
    mine = max((channel.round_trip() for channel in engine.channels
                if channel is not None and hasattr(channel, "round_trip")), default=0.0)
    store.set(f"latency/{rank}", repr(mine).encode())
    found = store.multi_get([f"latency/{r}" for r in range(size)], timeout)
    return max(float(value) for value in found) / 2


def _allowed(forced: str, interhost: str = "tcp") -> list[type[Transport]]:
    """The transports to set up: all available ones (MPI only for TCOLL_INTERHOST=mpi), or only the forced one."""
    if forced == "auto":
        skip = "tcp" if interhost == "mpi" else "mpi"
        return [cls for cls in TRANSPORTS if cls.name != skip and cls.available()]
    chosen = [cls for cls in TRANSPORTS if cls.name == forced]
    if not chosen or not chosen[0].available():
        hint = ": pip install 'tcoll[mpi]'" if forced == "mpi" else ""
        raise TransportError(f"TCOLL_TRANSPORT={forced} is not available on this machine{hint}")
    return chosen


def _assign(transports: list[Transport], cards: list[Card], rank: int, forced: str) -> dict[str, list[int]]:
    """Give each peer to the first transport that can reach it (the same choice on both sides)."""
    assignment: dict[str, list[int]] = {transport.name: [] for transport in transports}
    me = cards[rank]
    for peer, card in enumerate(cards):
        if peer == rank:
            continue
        for transport in transports:
            if transport.name in card and transport.name in me and transport.can_connect(me, card):
                assignment[transport.name].append(peer)
                break
        else:
            how = f"TCOLL_TRANSPORT={forced}" if forced != "auto" else "any transport"
            hint = " (the mpi transport needs every rank started by one mpiexec)" if forced == "mpi" else ""
            raise TransportError(f"rank {rank} cannot reach rank {peer} ({card['host']}) with {how}{hint}")
    return assignment


def _identity_card(rank: int) -> Card:
    """Who this rank is: host identity and process identity (for liveness checks)."""
    card: dict[str, Any] = {"rank": rank, "host": host_identity(), "pid": os.getpid(), "pidns": "",
                            "start_time": None}
    try:
        card["pidns"] = os.readlink("/proc/self/ns/pid")
        with open(f"/proc/{os.getpid()}/stat", "rb") as handle:
            card["start_time"] = int(handle.read().rpartition(b")")[2].split()[19])
    except OSError:
        pass
    return card
