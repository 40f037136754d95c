"""The host identity and the host map built from the identities exchanged at rendezvous."""

from __future__ import annotations

import os
import socket

import numpy as np

import tcoll
from tcoll.p2p.hosts import HostMap, host_identity


def test_identity_names_kernel_and_shm_mount() -> None:
    name, boot, shm = host_identity().split("/", 2)
    assert name == socket.gethostname() and boot
    device, mount = shm.split(":")
    assert int(device) == os.stat("/dev/shm").st_dev and mount.isdigit()


def test_host_map_numbers_hosts_by_lowest_rank() -> None:
    hosts = HostMap(["b/1/1:1", "a/1/1:1", "b/1/1:1", "a/1/1:1", "c/1/1:1"])
    assert hosts.host_of == [0, 1, 0, 1, 2] and hosts.count == 3
    assert hosts.members(1) == [1, 3] and hosts.local_ranks(2) == [0, 2]
    assert hosts.restrict([1, 2, 3]).host_of == [0, 1, 0]
    assert hosts.describe([3]) == "host a (ranks 1, 3)"
    # The same hostname with another /dev/shm mount is another host (containers with private /dev/shm).
    assert HostMap(["a/1/5:10", "a/1/6:11"]).count == 2


def _topology(comm: tcoll.Communicator) -> tuple[int, int, int, bool]:
    local = comm.split_type("shared")
    leaders = comm.leaders()
    total = local.all_reduce(np.ones(1))[0]
    return comm.hosts.count, local.size, int(total), leaders is not None and leaders.size == 1


def test_one_host_split_type_and_leaders() -> None:
    got = tcoll.spawn(_topology, 3, timeout=60)
    assert got == [(1, 3, 3, True), (1, 3, 3, False), (1, 3, 3, False)]


def _opt_out(comm: tcoll.Communicator) -> tuple[int, int, float, float] | None:
    """Rank 1 passes kind None (MPI_UNDEFINED): it gets None, and the others a communicator without it."""
    local = comm.split_type(None if comm.rank == 1 else "host", key=-comm.rank)
    after = float(comm.all_reduce(np.ones(1))[0])
    if local is None:
        return None
    return local.rank, local.size, float(local.all_reduce(np.full(1, comm.rank))[0]), after


def test_a_rank_opts_out_of_split_type() -> None:
    got = tcoll.spawn(_opt_out, 4, timeout=60)
    assert got == [(2, 3, 5.0, 4.0), None, (1, 3, 5.0, 4.0), (0, 3, 5.0, 4.0)], got  # ordered by key
