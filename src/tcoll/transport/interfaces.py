"""Which address a rank listens on and publishes for TCP: TCOLL_TCP_ADDR, TCOLL_SOCKET_IFNAME, or the route.

TCOLL_SOCKET_IFNAME is spelled as NCCL_SOCKET_IFNAME: a comma-separated list
of interface name prefixes ("eth", "ib0,eth0"); "=" in front makes them exact
names ("=eth0"), "^" excludes them ("^lo,docker0", "^=eth1"). Without it a
rank publishes the local address of its route to the rendezvous master. A job
that spans hosts never publishes a loopback address: when the master's name
resolves to one (gloo's classic trap: a hostname mapped to 127.0.1.1 in
/etc/hosts), the first address of an interface that is up and not loopback is
taken instead, or the job stops with an error that says what to set.
"""

from __future__ import annotations

import dataclasses
import fcntl
import ipaddress
import socket
import struct

from ..errors import TransportError

__all__ = ["Interface", "list_interfaces", "parse_ifname", "select_interfaces", "choose_address", "is_loopback"]

_SIOCGIFFLAGS = 0x8913
_SIOCGIFADDR = 0x8915
_IFF_UP = 0x1
_IFF_LOOPBACK = 0x8
_HINT = "set TCOLL_SOCKET_IFNAME (e.g. eth0, or ^lo,docker0) or TCOLL_TCP_ADDR"


@dataclasses.dataclass(frozen=True)
class Interface:
    """A network interface with an IPv4 address.

    Attributes:
        name: e.g. "eth0".
        addr: its IPv4 address.
        up: whether the interface is up.
        loopback: whether it is a loopback interface.
    """

    name: str
    addr: str
    up: bool
    loopback: bool


def list_interfaces() -> list[Interface]:
    """The interfaces of this network namespace that have an IPv4 address, in kernel index order."""
    found = []
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        for _, name in socket.if_nameindex():
            request = struct.pack("256s", name.encode()[:15])
            try:
                flags = struct.unpack_from("H", fcntl.ioctl(probe.fileno(), _SIOCGIFFLAGS, request), 16)[0]
                raw = fcntl.ioctl(probe.fileno(), _SIOCGIFADDR, request)
            except OSError:  # no IPv4 address on it
                continue
            addr = socket.inet_ntoa(raw[20:24])
            found.append(Interface(name, addr, bool(flags & _IFF_UP), bool(flags & _IFF_LOOPBACK)))
    return found


def parse_ifname(spec: str) -> tuple[bool, bool, list[str]]:
    """Parse a TCOLL_SOCKET_IFNAME value.

    Returns:
        (exclude, exact, names): "^" excludes, "=" matches whole names, else prefixes.

    Raises:
        ValueError: no name in the list.
    """
    text = spec.strip()
    exclude = text.startswith("^")
    text = text[1:] if exclude else text
    exact = text.startswith("=")
    text = text[1:] if exact else text
    names = [name.strip() for name in text.split(",") if name.strip()]
    if not names:
        raise ValueError(f"TCOLL_SOCKET_IFNAME={spec!r} names no interface")
    return exclude, exact, names


def select_interfaces(spec: str, interfaces: list[Interface]) -> list[Interface]:
    """The interfaces (up, with an address) that TCOLL_SOCKET_IFNAME=`spec` allows, in order."""
    exclude, exact, names = parse_ifname(spec)

    def named(iface: Interface) -> bool:
        return any(iface.name == name if exact else iface.name.startswith(name) for name in names)

    return [iface for iface in interfaces if iface.up and named(iface) != exclude]


def is_loopback(host: str) -> bool:
    """Whether `host` names this machine's loopback interface."""
    if host.lower() in ("localhost", "localhost.localdomain"):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _route_to(master_host: str) -> str:
    """The local address of the route to `master_host` (a UDP connect only consults the routing table)."""
    try:
        info = socket.getaddrinfo(master_host, 9, type=socket.SOCK_DGRAM)[0]
        with socket.socket(info[0], socket.SOCK_DGRAM) as probe:
            probe.connect(info[4])
            return str(probe.getsockname()[0])
    except OSError as exc:
        raise TransportError(f"tcp transport: cannot find the local address of the route to the master "
                             f"{master_host!r} ({exc}); {_HINT}") from None


def choose_address(tcp_addr: str, master_host: str | None, ifname: str = "",
                   interfaces: list[Interface] | None = None) -> str:
    """Pick the address this rank listens on and publishes.

    Args:
        tcp_addr: TCOLL_TCP_ADDR ("" when unset): used as it is.
        master_host: the rendezvous master's host; None or a loopback name for a job on one host.
        ifname: TCOLL_SOCKET_IFNAME ("" when unset).
        interfaces: the interfaces to choose from (default: this namespace's; for tests).

    Returns:
        The address. A job on one host without TCOLL_SOCKET_IFNAME listens on 127.0.0.1;
        a job across hosts never gets a loopback address unless TCOLL_SOCKET_IFNAME names one.

    Raises:
        TransportError: no interface fits TCOLL_SOCKET_IFNAME, or none but loopback is up.
    """
    if tcp_addr:
        return tcp_addr
    one_host = master_host is None or is_loopback(master_host)
    if ifname:
        available = list_interfaces() if interfaces is None else interfaces
        chosen = select_interfaces(ifname, available)
        if not chosen:
            have = ", ".join(f"{i.name}={i.addr}{'' if i.up else ' (down)'}" for i in available) or "none"
            raise TransportError(f"tcp transport: no interface that is up matches TCOLL_SOCKET_IFNAME={ifname!r} "
                                 f"(interfaces with IPv4 addresses: {have})")
        return chosen[0].addr
    if one_host:
        return "127.0.0.1"
    addr = _route_to(master_host)  # type: ignore[arg-type]
    if not is_loopback(addr):
        return addr
    available = list_interfaces() if interfaces is None else interfaces
    usable = [iface for iface in available if iface.up and not iface.loopback]
    if not usable:
        raise TransportError(f"tcp transport: the master {master_host!r} resolves to this machine's loopback "
                             f"({addr}) and no other interface is up, so no other host could reach this rank; "
                             f"{_HINT}")
    return usable[0].addr
