"""Every transport passes the same point-to-point battery, for world sizes 1 to 8.

A world is started once per (transport, size, settings) and runs every check;
each check is then reported as its own test, so a failure names the check,
the transport and the world size.
"""

from __future__ import annotations


import pytest

import tcoll
from helpers.conformance import CHECKS, check_one_gib, run_battery

SIZES = [1, 2, 3, 4, 5, 6, 7, 8]
# Processes cost more than threads: shm and tcp take odd, even and non-power-of-two sizes, not every size
# (loopback, which runs the same engine, takes every one).
PROCESS_SIZES = {"shm": [2, 3, 4, 5, 8], "tcp": [2, 3, 5, 8]}
# Tiny rings and chunks push every message through the multi-chunk and
# wrap-around paths; a tiny eager limit sends most unexpected messages down
# the "leave it in the channel" path.
SMALL = {"shm_chunk": "1K", "shm_ring": "8K", "eager_limit": "2K"}
WORLDS = (
    [("loopback", n, "default") for n in SIZES]
    + [("loopback", n, "small") for n in (2, 3, 5)]
    + [("shm", n, "default") for n in PROCESS_SIZES["shm"]]
    + [("shm", n, "small") for n in (2, 3, 5)]
    + [("tcp", n, "default") for n in PROCESS_SIZES["tcp"]]
    + [("tcp", n, "small") for n in (2, 3)]
)

_reports: dict[tuple[str, int, str], list[dict[str, str | None]]] = {}


def _run_world(transport: str, size: int, variant: str) -> list[dict[str, str | None]]:
    key = (transport, size, variant)
    if key not in _reports:
        knobs = dict(SMALL) if variant == "small" else {}
        if transport == "loopback":
            _reports[key] = tcoll.spawn(run_battery, size, threads=True, timeout=240, **knobs)
        else:
            _reports[key] = tcoll.spawn(run_battery, size, timeout=240, transport=transport, **knobs)
    return _reports[key]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", list(CHECKS))
@pytest.mark.parametrize("transport,size,variant", WORLDS, ids=[f"{t}-{n}-{v}" for t, n, v in WORLDS])
def test_conformance(transport: str, size: int, variant: str, name: str) -> None:
    if name == "torch_tensors":
        pytest.importorskip("torch")
    reports = _run_world(transport, size, variant)
    failures = {rank: report[name] for rank, report in enumerate(reports) if report[name]}
    assert not failures, "\n".join(f"rank {rank}:\n{text}" for rank, text in failures.items())


def _transport_used(comm: tcoll.Communicator) -> list[str]:
    return sorted({comm.transport(peer) for peer in range(comm.size) if peer != comm.rank})


@pytest.mark.timeout(120)
@pytest.mark.parametrize("transport", ["loopback", "shm", "tcp"])
def test_transport_is_the_one_asked_for(transport: str) -> None:
    if transport == "loopback":
        used = tcoll.spawn(_transport_used, 3, threads=True, timeout=60)
    else:
        used = tcoll.spawn(_transport_used, 3, timeout=60, transport=transport)
    assert used == [[transport]] * 3


@pytest.mark.timeout(120)
def test_auto_picks_shm_between_processes_of_one_host() -> None:
    assert tcoll.spawn(_transport_used, 2, timeout=60) == [["shm"]] * 2


@pytest.mark.timeout(300)
@pytest.mark.parametrize("transport", ["loopback", "shm", "tcp"])
def test_one_gib_message(transport: str) -> None:
    if transport == "loopback":
        tcoll.spawn(check_one_gib, 2, threads=True, timeout=240)
    else:
        tcoll.spawn(check_one_gib, 2, timeout=240, transport=transport)

