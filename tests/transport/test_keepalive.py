"""TCOLL_TCP_DEAD_AFTER: the keep-alive and user-timeout options on every tcoll TCP connection.

The behaviour itself (a vanished host is a PeerLostError within that time) is
tested across namespace-hosts in tests/hosts; here, the options each
connection really carries.
"""

from __future__ import annotations

import socket
import threading
from typing import Any

import pytest

from tcoll import keepalive
from tcoll.env import Settings
from tcoll.store import TCPStore, TCPStoreServer
from tcoll.transport.tcp.connect import connect_all, open_listener

pytestmark = pytest.mark.timeout(60)

LINUX = all(hasattr(socket, name) for name in ("TCP_KEEPIDLE", "TCP_KEEPINTVL", "TCP_KEEPCNT", "TCP_USER_TIMEOUT"))
NO_USER_TIMEOUT = 0  # never set: it would fail a live receiver that only reads late (a zero window)


def _carried(sock: socket.socket) -> dict[str, int]:
    """The keep-alive options a socket carries, read back from the kernel."""
    found = {"SO_KEEPALIVE": sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE)}
    for name in ("TCP_KEEPIDLE", "TCP_KEEPINTVL", "TCP_KEEPCNT", "TCP_USER_TIMEOUT"):
        found[name] = sock.getsockopt(socket.IPPROTO_TCP, getattr(socket, name))
    return found


@pytest.mark.parametrize("dead_after", [1, 2, 5, 10, 300])
def test_the_probes_give_up_within_the_limit(dead_after: float) -> None:
    chosen = dict(keepalive.dead_after_options(dead_after))
    probing = chosen["TCP_KEEPIDLE"] + chosen["TCP_KEEPCNT"] * chosen["TCP_KEEPINTVL"]
    assert probing <= max(dead_after, 2)  # 1 s is the kernel's smallest step, at idle and per probe
    assert "TCP_USER_TIMEOUT" not in chosen
    assert dict(keepalive.dead_after_options(dead_after, user_timeout=True))["TCP_USER_TIMEOUT"] == dead_after * 1000
    assert chosen["TCP_KEEPCNT"] >= 1 and chosen["TCP_KEEPIDLE"] >= 1


def test_the_default_is_the_earlier_fixed_keepalive_timing_and_settings_agree() -> None:
    assert keepalive.dead_after_options(keepalive.DEFAULT_DEAD_AFTER) == [
        ("TCP_KEEPIDLE", 2), ("TCP_KEEPINTVL", 1), ("TCP_KEEPCNT", 3)]
    assert Settings().tcp_dead_after == keepalive.DEFAULT_DEAD_AFTER
    assert Settings.from_env({"TCOLL_TCP_DEAD_AFTER": "2.5"}).tcp_dead_after == 2.5
    assert keepalive.dead_after_from_env({}) == keepalive.DEFAULT_DEAD_AFTER
    assert keepalive.dead_after_from_env({"TCOLL_TCP_DEAD_AFTER": "7"}) == 7.0


@pytest.mark.parametrize("text", ["0.5", "-1", "1e6", "soon"])
def test_bad_values_are_refused_naming_the_variable(text: str) -> None:
    with pytest.raises(ValueError, match="TCOLL_TCP_DEAD_AFTER"):
        keepalive.dead_after_from_env({"TCOLL_TCP_DEAD_AFTER": text})
    with pytest.raises(ValueError, match="TCOLL_TCP_DEAD_AFTER|tcp_dead_after"):
        Settings.from_env({"TCOLL_TCP_DEAD_AFTER": text})


@pytest.mark.skipif(not LINUX, reason="TCP_KEEPIDLE and TCP_USER_TIMEOUT are Linux's")
def test_ranks_connections_carry_the_options() -> None:
    listeners = [open_listener("127.0.0.1"), open_listener("127.0.0.1")]
    cards: list[dict[str, Any]] = [{"tcp": {"addr": "127.0.0.1", "port": lst.getsockname()[1]}} for lst in listeners]
    got: dict[int, Any] = {}
    thread = threading.Thread(target=lambda: got.update(links=connect_all(0, [1], cards, listeners[0], "run", "",
                                                                          30, dead_after=3)))
    thread.start()
    links = connect_all(1, [0], cards, listeners[1], "run", "", 30, dead_after=3)
    thread.join(30)
    try:
        want = {"SO_KEEPALIVE": 1, "TCP_USER_TIMEOUT": NO_USER_TIMEOUT, **dict(keepalive.dead_after_options(3))}
        for sock in [*links.values(), *got["links"].values()]:  # the dialler's and the acceptor's ends
            assert _carried(sock) == want
    finally:
        for sock in [*links.values(), *got.get("links", {}).values(), *listeners]:
            sock.close()


@pytest.mark.skipif(not LINUX, reason="TCP_KEEPIDLE and TCP_USER_TIMEOUT are Linux's")
def test_store_clients_carry_the_options(monkeypatch: pytest.MonkeyPatch) -> None:
    server = TCPStoreServer("127.0.0.1", 0)
    monkeypatch.setenv("TCOLL_TCP_DEAD_AFTER", "4")
    try:
        for client, seconds in ((TCPStore("127.0.0.1", server.port, 10), 4),
                                (TCPStore("127.0.0.1", server.port, 10, dead_after=2), 2)):
            client.set("k", b"v")
            assert client.get("k") == b"v"
            [sock] = client._idle  # the pooled connection the requests used
            assert _carried(sock) == {"SO_KEEPALIVE": 1,  # (a store's server always reads: a user timeout too)
                                      **dict(keepalive.dead_after_options(seconds, user_timeout=True))}
            client.close()
        off = TCPStore("127.0.0.1", server.port, 10, dead_after=0)
        [sock] = off._idle
        assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 0  # 0: the kernel's defaults
        off.close()
    finally:
        server.close()


def _late_receiver(comm: Any) -> float:
    """Rank 1 reaches its receive of 16 MiB 3 s after rank 0 sent it: a live peer, with a full window meanwhile."""
    import time

    import numpy as np

    data = np.ones(2 << 20)
    if comm.rank == 0:
        comm.send(data, 1)
        return 0.0
    time.sleep(3)  # the scenario itself (a rank late to its receive), not a synchronisation
    comm.recv(data, 0)
    return float(data.sum())


def test_a_live_receiver_that_reads_late_is_not_lost() -> None:
    """TCOLL_TCP_DEAD_AFTER=1 bounds silence, not slowness: the sender's data waits for a late live receiver."""
    import tcoll

    results = tcoll.spawn(_late_receiver, 2, timeout=40, transport="tcp", env={"TCOLL_TCP_DEAD_AFTER": "1"})
    assert results == [0.0, float(2 << 20)]
