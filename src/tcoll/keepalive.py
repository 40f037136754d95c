"""How every tcoll TCP connection notices a peer whose host vanished: keep-alive.

A host that goes away without closing its connections (power, link, kernel
panic, a namespace-host cut off) sends no FIN and no RST, so by the kernel's
defaults its peers learn of it after about two hours of keep-alive silence,
or after 15 minutes of retransmissions. `set_dead_after` bounds the first by one setting,
TCOLL_TCP_DEAD_AFTER (`tcoll.env.Settings.tcp_dead_after`, seconds): an idle
connection sends a keep-alive probe after about 2/5 of it, then one every 1/5,
and fails once the probes stay unanswered.

TCP_USER_TIMEOUT is not set: it also fails a connection whose live receiver
only reads late (a zero window for that long: a rank that reaches its receive
of a large message a few seconds after the sender), which would declare a
live rank dead. A host that vanishes while data to it is unacknowledged is
seen when the call's own timeout (TCOLL_TIMEOUT) ends the wait, or by the
kernel's retransmission limit.

The failure shows as an error on the socket: a rank's channel reports it as
`PeerLostError` at its next liveness check; a store client as a lost store.
The cost is one small packet per idle connection per probe interval.
"""

from __future__ import annotations

import math
import os
import socket
from collections.abc import Mapping

__all__ = ["DEFAULT_DEAD_AFTER", "dead_after_from_env", "dead_after_options", "set_dead_after"]

DEFAULT_DEAD_AFTER = 5.0
"""Seconds of silence after which a TCP peer counts as lost (TCOLL_TCP_DEAD_AFTER's default)."""

_MAX_DEAD_AFTER = 86400.0  # a day: beyond it the kernel's own defaults (hours) are as good


def dead_after_options(dead_after: float) -> list[tuple[str, int]]:
    """The TCP-level options (name in `socket`, value) that make a silent peer fail after `dead_after` s.

    Args:
        dead_after: seconds, 1..86400; 0 means none (the kernel's defaults).

    Returns:
        [("TCP_KEEPIDLE", s), ("TCP_KEEPINTVL", s), ("TCP_KEEPCNT", n)], or [] for 0. For the
        default 5 s: idle 2 s, then 3 probes a second apart.

    Raises:
        ValueError: `dead_after` is out of range.
    """
    if dead_after == 0:
        return []
    if not 1 <= dead_after <= _MAX_DEAD_AFTER:
        raise ValueError(f"TCOLL_TCP_DEAD_AFTER must be 0 (off) or 1..86400 seconds, not {dead_after:g}")
    idle = max(1, int(dead_after * 0.4))  # the kernel counts these in whole seconds
    interval = max(1, int(dead_after * 0.2))
    count = max(1, math.ceil((dead_after - idle) / interval))
    return [("TCP_KEEPIDLE", idle), ("TCP_KEEPINTVL", interval), ("TCP_KEEPCNT", count)]


def set_dead_after(sock: socket.socket, dead_after: float) -> None:
    """Turn on keep-alive and set `dead_after_options(dead_after)` on a connected TCP socket.

    Options this platform lacks are skipped (TCP_USER_TIMEOUT and TCP_KEEPIDLE are Linux's;
    elsewhere only SO_KEEPALIVE applies, with the system's timing).

    Args:
        sock: a TCP socket.
        dead_after: seconds (see `dead_after_options`); 0 leaves keep-alive off and the kernel's defaults.

    Raises:
        ValueError: `dead_after` is out of range.
    """
    chosen = dead_after_options(dead_after)
    if not chosen:
        return
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in chosen:
        if hasattr(socket, name):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)


def dead_after_from_env(environ: Mapping[str, str] | None = None) -> float:
    """TCOLL_TCP_DEAD_AFTER from `environ` (default: os.environ), for code that has no Settings (store clients).

    Returns:
        Seconds; `DEFAULT_DEAD_AFTER` when unset or empty.

    Raises:
        ValueError: the variable is not a number in range (the message names it).
    """
    text = (os.environ if environ is None else environ).get("TCOLL_TCP_DEAD_AFTER", "")
    if not text.strip():
        return DEFAULT_DEAD_AFTER
    try:
        value = float(text)
        dead_after_options(value)
    except ValueError as exc:
        raise ValueError(f"TCOLL_TCP_DEAD_AFTER={text!r}: {exc}") from None
    return value
