"""A rank meeting its peers over TCP: silent strangers at its listener cannot take all its descriptors."""

from __future__ import annotations

import socket
import threading
from typing import Any

import pytest
from helpers.procs import hung_up

from tcoll.transport.tcp import connect as tcp_connect
from tcoll.transport.tcp.connect import connect_all, open_listener

pytestmark = pytest.mark.timeout(60)

KEY = "the job's key"


def test_silent_strangers_are_capped_and_the_peer_still_gets_in() -> None:
    listeners = [open_listener("127.0.0.1"), open_listener("127.0.0.1")]
    cards: list[dict[str, Any]] = [{"tcp": {"addr": "127.0.0.1", "port": lst.getsockname()[1]}} for lst in listeners]
    got: dict[int, Any] = {}

    def rank0() -> None:
        try:
            got[0] = connect_all(0, [1], cards, listeners[0], "run", KEY, 30)
        except Exception as exc:  # noqa: BLE001 - reported below
            got[0] = exc

    thread = threading.Thread(target=rank0)
    thread.start()
    extra = 36
    strangers = [socket.create_connection(("127.0.0.1", cards[0]["tcp"]["port"]))
                 for _ in range(tcp_connect._MIN_PENDING + extra)]
    try:
        for sock in strangers[:extra]:  # the oldest made room for the newest
            assert hung_up(sock, 10), "a silent stranger kept its place past the cap"
        links = connect_all(1, [0], cards, listeners[1], "run", KEY, 30)  # and the real peer still gets in
        thread.join(30)
        assert isinstance(got.get(0), dict) and set(got[0]) == {1}, got
        assert set(links) == {0}
        for sock in [*links.values(), *got[0].values()]:
            sock.close()
    finally:
        thread.join(30)
        for sock in [*strangers, *listeners]:
            sock.close()
