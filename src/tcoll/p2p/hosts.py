"""Which ranks share a host: an identity each rank publishes at rendezvous, and the map built from them.

A *host* here is what shared memory can span: one kernel (hostname and boot
id) and one /dev/shm (the device number of its file system and the id of its
mount in this process's mount namespace). Two containers on one machine with
private /dev/shm mounts are therefore two hosts, as they must be: their ranks
cannot map each other's segments. The launcher's LOCAL_WORLD_SIZE is never
consulted: it describes how the launcher started processes, not what they
can share.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Sequence

__all__ = ["host_identity", "HostMap"]

_SHM = "/dev/shm"


def _shm_mount_id() -> str:
    """The mount id of the mount /dev/shm lives on, from /proc/self/mountinfo ("" if unknown)."""
    best, best_len = "", -1
    try:
        with open("/proc/self/mountinfo") as handle:
            for line in handle:
                fields = line.split()
                if len(fields) < 5:
                    continue
                point = fields[4]
                # The longest mount point that is /dev/shm or a parent of it is the one it lives on.
                if (_SHM == point or _SHM.startswith(point.rstrip("/") + "/")) and len(point) > best_len:
                    best, best_len = fields[0], len(point)
    except OSError:
        return ""
    return best


def host_identity() -> str:
    """This rank's host identity: "hostname/boot id/shm device:mount id".

    Equal identities mean one kernel and one /dev/shm, so shared memory works between the ranks.
    """
    try:
        with open("/proc/sys/kernel/random/boot_id") as handle:
            boot = handle.read().strip()
    except OSError:
        boot = ""
    try:
        device = os.stat(_SHM).st_dev
    except OSError:
        device = -1
    return f"{socket.gethostname()}/{boot}/{device}:{_shm_mount_id()}"


class HostMap:
    """The hosts of a world: which host each rank is on, numbered in order of their lowest rank.

    Args:
        identities: the host identity of each world rank.

    Attributes:
        host_of: the host index of each world rank (rank 0's host is 0).
        names: each host's hostname (the first part of its identity).
    """

    __slots__ = ("host_of", "names", "_members", "_identities")

    def __init__(self, identities: Sequence[str]) -> None:
        self._identities = list(identities)
        index: dict[str, int] = {}
        self.host_of = [index.setdefault(ident, len(index)) for ident in identities]
        self.names = [ident.split("/", 1)[0] for ident in index]
        self._members: list[list[int]] = [[] for _ in index]
        for rank, host in enumerate(self.host_of):
            self._members[host].append(rank)

    @classmethod
    def single(cls, size: int) -> HostMap:
        """Every one of `size` ranks on one host (threads of a process, or before rendezvous)."""
        return cls(["local"] * size)

    @property
    def count(self) -> int:
        """The number of hosts."""
        return len(self._members)

    def members(self, host: int) -> list[int]:
        """The world ranks on `host`, ascending."""
        return list(self._members[host])

    def local_ranks(self, rank: int) -> list[int]:
        """The world ranks on `rank`'s host (itself included), ascending."""
        return self.members(self.host_of[rank])

    def restrict(self, ranks: Sequence[int]) -> HostMap:
        """The map of a communicator made of world `ranks`: its rank i is world rank ranks[i]."""
        return HostMap([self._identities[r] for r in ranks])

    def describe(self, ranks: Sequence[int]) -> str:
        """ "host NAME (ranks a, b)" for the hosts of `ranks`, for error messages."""
        hosts = sorted({self.host_of[r] for r in ranks})
        return "; ".join(f"host {self.names[h]} (ranks {', '.join(map(str, self._members[h]))})" for h in hosts)

    def __repr__(self) -> str:
        return f"HostMap({self.count} hosts: {[self._members[h] for h in range(self.count)]})"
