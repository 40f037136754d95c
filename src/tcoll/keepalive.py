"""How every tcoll TCP connection notices a peer whose host vanished: keep-alive.

A host that goes away without closing its connections (power, link, kernel
panic, a namespace-host cut off) sends no FIN and no RST, so by the kernel's
defaults its peers learn of it after about two hours of keep-alive silence,
or after 15 minutes of retransmissions. `set_dead_after` bounds the first by one setting,
TCOLL_TCP_DEAD_AFTER (`tcoll.env.Settings.tcp_dead_after`, seconds): an idle
connection sends a keep-alive probe after about 2/5 of it, then one every 1/5,
and fails once the probes stay unanswered.

A ranks' channel sets no TCP_USER_TIMEOUT: it also fails a connection whose
live receiver only reads late (a zero window for that long: a rank that reaches
its receive of a large message a few seconds after the sender), which would
declare a live rank dead. A channel instead asks the kernel, at its liveness
checks, how long data to the peer has gone unacknowledged (TCP_INFO: a live
receiver acknowledges what it was sent even with a full buffer; `unacked_for`).
A store client, whose server always reads, sets TCP_USER_TIMEOUT to the limit.

The failure shows as an error on the socket: a rank's channel reports it as
`PeerLostError` at its next liveness check; a store client as a lost store.
The cost is one small packet per idle connection per probe interval.
"""

from __future__ import annotations

import math
import os
import socket
from collections.abc import Mapping

__all__ = ["DEFAULT_DEAD_AFTER", "dead_after_from_env", "dead_after_options", "set_dead_after", "unacked_for"]

DEFAULT_DEAD_AFTER = 5.0
"""Seconds of silence after which a TCP peer counts as lost (TCOLL_TCP_DEAD_AFTER's default)."""

_MAX_DEAD_AFTER = 86400.0  # a day: beyond it the kernel's own defaults (hours) are as good


def dead_after_options(dead_after: float, user_timeout: bool = False) -> list[tuple[str, int]]:
    """The TCP-level options (name in `socket`, value) that make a silent peer fail after `dead_after` s.

    Args:
        dead_after: seconds, 1..86400; 0 means none (the kernel's defaults).
        user_timeout: also fail the connection when data stays unacknowledged that long (for a peer
            that always reads: a store's server), with ("TCP_USER_TIMEOUT", ms) last.

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
    chosen = [("TCP_KEEPIDLE", idle), ("TCP_KEEPINTVL", interval), ("TCP_KEEPCNT", count)]
    return chosen + [("TCP_USER_TIMEOUT", int(dead_after * 1000))] if user_timeout else chosen


def set_dead_after(sock: socket.socket, dead_after: float, user_timeout: bool = False) -> None:
    """Turn on keep-alive and set `dead_after_options(dead_after)` on a connected TCP socket.

    Options this platform lacks are skipped (TCP_USER_TIMEOUT and TCP_KEEPIDLE are Linux's;
    elsewhere only SO_KEEPALIVE applies, with the system's timing).

    Args:
        sock: a TCP socket.
        dead_after: seconds (see `dead_after_options`); 0 leaves keep-alive off and the kernel's defaults.
        user_timeout: see `dead_after_options`.

    Raises:
        ValueError: `dead_after` is out of range.
    """
    chosen = dead_after_options(dead_after, user_timeout)
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


def unacked_for(sock: socket.socket) -> float:
    """Seconds since the peer last acknowledged anything, while data to it is unacknowledged; else 0.

    From the kernel's TCP_INFO (tcpi_unacked, tcpi_last_ack_recv). A live peer acknowledges every
    segment it receives, even with its buffer full (it then advertises a zero window, and the
    sender's window probes carry no new data), so only a peer whose host stopped answering makes
    this grow. 0 where TCP_INFO is not available.
    """
    try:
        info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 104)
    except (OSError, AttributeError):
        return 0.0
    if len(info) < 60:
        return 0.0
    # struct tcp_info: 8 bytes of u8 fields, then u32s: tcpi_unacked is the 5th, tcpi_last_ack_recv the 13th.
    unacked = int.from_bytes(info[24:28], "little")
    return int.from_bytes(info[56:60], "little") / 1000.0 if unacked else 0.0
