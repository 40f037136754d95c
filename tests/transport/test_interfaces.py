"""Interface choice (TCOLL_SOCKET_IFNAME, loopback never published across hosts) and the unreachable peer's error."""

from __future__ import annotations

import socket

import pytest

from tcoll.errors import TimeoutError, TransportError
from tcoll.transport import interfaces
from tcoll.transport.interfaces import Interface, choose_address, parse_ifname, select_interfaces
from tcoll.transport.tcp.connect import connect_all, open_listener

IFACES = [Interface("lo", "127.0.0.1", True, True), Interface("docker0", "172.17.0.1", True, False),
          Interface("eth0", "10.0.0.5", True, False), Interface("eth1", "10.1.0.5", False, False),
          Interface("ib0", "10.2.0.5", True, False)]


def test_parse_ifname_spellings() -> None:
    assert parse_ifname("eth0") == (False, False, ["eth0"])
    assert parse_ifname("^lo,docker0") == (True, False, ["lo", "docker0"])
    assert parse_ifname("^=eth1") == (True, True, ["eth1"])
    with pytest.raises(ValueError):
        parse_ifname("^")


def test_select_by_prefix_exact_and_exclusion() -> None:
    assert [i.name for i in select_interfaces("eth", IFACES)] == ["eth0"]  # eth1 is down
    assert [i.name for i in select_interfaces("^lo,docker0", IFACES)] == ["eth0", "ib0"]
    assert [i.name for i in select_interfaces("=ib", IFACES)] == []
    assert choose_address("", "10.0.0.1", "ib0", IFACES) == "10.2.0.5"
    assert choose_address("", "10.0.0.1", "^lo,docker0", IFACES) == "10.0.0.5"
    assert choose_address("10.9.9.9", "10.0.0.1", "ib0", IFACES) == "10.9.9.9"  # TCOLL_TCP_ADDR wins


def test_no_matching_interface_lists_what_there_is() -> None:
    with pytest.raises(TransportError, match=r"TCOLL_SOCKET_IFNAME='=eth1'.*eth0=10.0.0.5.*eth1=10.1.0.5 \(down\)"):
        choose_address("", "10.0.0.1", "=eth1", IFACES)


def test_one_host_job_stays_on_loopback() -> None:
    assert choose_address("", None, "", IFACES) == "127.0.0.1"
    assert choose_address("", "localhost", "", IFACES) == "127.0.0.1"


def test_master_resolving_to_loopback_never_publishes_loopback(monkeypatch: pytest.MonkeyPatch) -> None:
    """gloo's trap: the master's hostname maps to 127.0.1.1; a multi-host job must publish a real address."""
    monkeypatch.setattr(interfaces, "_route_to", lambda host: "127.0.1.1")
    assert choose_address("", "node0", "", IFACES) == "172.17.0.1"
    with pytest.raises(TransportError, match="loopback"):
        choose_address("", "node0", "", IFACES[:1])


def test_unreachable_peer_error_names_both_ranks_and_the_address() -> None:
    listener = open_listener("127.0.0.1")
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]  # bound, never listening: connections are refused
        cards = [{"tcp": {"addr": "127.0.0.1", "port": port}}, {}]
        with pytest.raises(TimeoutError) as info:
            connect_all(1, [0], cards, listener, "run", "", 0.3)
    listener.close()
    text = str(info.value)
    assert "rank 1 (listening at 127.0.0.1:" in text and f"rank 0: dialled 127.0.0.1:{port}" in text
