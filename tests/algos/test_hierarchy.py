"""Hierarchical collectives against NumPy, on thread ranks given hosts of a chosen layout, and their costs."""

from __future__ import annotations

import numpy as np
import pytest

import tcoll
from comm.test_collectives import MATRIX, _report, run_movement, run_reduction
from tcoll.algos import select
from tcoll.algos.hierarchy import topology_of
from tcoll.p2p.hosts import HostMap

HIERARCHICAL = [("all_reduce", "hierarchical"), ("all_reduce", "hierarchical_sliced"),
                ("reduce_scatter", "hierarchical"), ("all_gather", "hierarchical"), ("broadcast", "hierarchical")]
PAIRS = [("sum", np.dtype(np.float32)), ("max", np.dtype(np.int64)), ("bor", np.dtype(np.uint8)),
         ("matmul", MATRIX)]


def run_on_hosts(comm: tcoll.Communicator, layout: list[int]) -> list[str]:
    """Pretend rank r lives on host layout[r], then run every hierarchical algorithm."""
    comm.core.engine.hosts = HostMap([f"host{h}/boot/1:1" for h in layout])
    failures: list[str] = []
    for collective, algorithm in HIERARCHICAL:
        if collective in ("all_reduce", "reduce_scatter"):
            failures += run_reduction(comm, collective, algorithm, PAIRS, (0, 1, 37))
        else:
            failures += run_movement(comm, collective, algorithm, [np.dtype(np.float64), np.dtype(np.int8)],
                                     (0, 1, 37))
    if comm.hosts.count != len(set(layout)):
        failures.append(f"comm.hosts: {comm.hosts!r}")
    return failures


@pytest.mark.timeout(120)
@pytest.mark.parametrize("layout", [[0, 0, 1, 1], [0, 1, 0, 1, 2, 2], [0, 0, 1, 2, 2, 2], [0, 0, 0], [0, 1, 2], [0]],
                         ids=["2x2", "interleaved", "uneven", "one-host", "one-per-host", "single"])
def test_hierarchical_algorithms_match_numpy(layout: list[int]) -> None:
    _report(tcoll.spawn(run_on_hosts, len(layout), (layout,), threads=True, timeout=100, coll_chunk="64"))


def test_cost_model_chooses_hierarchy_across_hosts_only() -> None:
    topology = topology_of(2, 2)
    big = select.choose("all_reduce", 1 << 20, 4, topology.inter, topology=topology)
    assert big.hierarchical
    assert not select.choose("all_reduce", 1 << 20, 4, select.COSTS["tcp"]).hierarchical  # no topology
    assert topology_of(1, 4) is None
    slow = topology_of(2, 2, link_latency=1e-3)  # 1 ms between hosts (tc netem)
    assert slow.inter.alpha == 1e-3
    for collective, nbytes in (("all_reduce", 1 << 20), ("all_gather", 1 << 18), ("broadcast", 1 << 20),
                               ("reduce_scatter", 1 << 20)):
        assert select.choose(collective, nbytes, 4, slow.inter, topology=slow).hierarchical, collective


def test_explain_shows_the_hierarchy_and_its_predicted_time() -> None:
    text = tcoll.explain("all_reduce", 1 << 30, hosts=1024, ranks_per_host=8)
    assert "1024 hosts x 8 ranks" in text
    assert "chosen hierarchy (hierarchical" in text and "predicted" in text
    assert "(inter" in text and "(intra:" in text
