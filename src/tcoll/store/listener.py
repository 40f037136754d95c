"""The TCP store server's listening socket."""

from __future__ import annotations

import errno
import socket

from ..errors import RendezvousError

__all__ = ["bind_listener"]


def bind_listener(host: str, port: int, backlog: int) -> socket.socket:
    """Listen, non-blocking, on exactly `host` ("" or "0.0.0.0": every interface).

    Raises:
        RendezvousError: the address cannot be bound (port in use, unknown host).
    """
    where = f"{host or '*'}:{port}"
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(
            host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
    except socket.gaierror as exc:
        raise RendezvousError(
            f"cannot host the tcoll store at {where}: unknown host ({exc})", address=f"tcp://{where}"
        ) from None
    sock = socket.socket(family, kind, proto)
    try:
        # SO_REUSEADDR lets a new job bind while old connections sit in TIME_WAIT;
        # it does not let two listeners share the port.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.listen(backlog)
        sock.setblocking(False)
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise RendezvousError(
                f"cannot host the tcoll store at {where}: the port is already in use (another job, or a store "
                "left running by an earlier one); pick another port, e.g. TCOLL_MASTER=host:PORT or MASTER_PORT",
                address=f"tcp://{where}",
            ) from None
        raise RendezvousError(f"cannot host the tcoll store at {where}: {exc}", address=f"tcp://{where}") from None
    return sock
