"""The recorder runs every point-to-point algorithm without moving data, and its schedules agree with
the cost model's message and byte counts (tcoll.algos.traffic) for world sizes 1 to 64."""

from __future__ import annotations

import pytest

import tcoll.comm.dispatch  # noqa: F401 - registers every algorithm
from tcoll.algos.record import record
from tcoll.algos.registry import REGISTRY
from tcoll.algos.traffic import traffic

# The hierarchical algorithms are steps of these on sub-teams inside and between hosts (tests/algos/test_hierarchy.py).
TEAM_ALGORITHMS = [(collective, name) for collective, infos in REGISTRY.items()
                   for name, info in infos.items() if not info.direct and not info.hierarchical]
SIZES = [*range(1, 33), 37, 48, 63, 64]  # every size to 32, then odd, even and the ends up to 64 (fast)
PIPELINED = {("all_reduce", "ring"), ("reduce_scatter", "ring"), ("all_gather", "ring"),
             ("broadcast", "scatter_allgather"), ("broadcast", "chain")}


def test_every_point_to_point_algorithm_has_a_traffic_formula() -> None:
    assert len(TEAM_ALGORITHMS) >= 20
    for collective, name in TEAM_ALGORITHMS:
        assert traffic(collective, name, 1024, 4) is not None, (collective, name)


@pytest.mark.parametrize(("collective", "name"), TEAM_ALGORITHMS)
def test_recorded_messages_and_bytes_are_the_formulas(collective: str, name: str) -> None:
    for size in SIZES:
        # divides into any algorithm's blocks: the vector ones cut n into p (or pof2) blocks
        count = 64 * size if collective in ("all_reduce", "reduce", "broadcast") else 64
        schedule = record(collective, name, size, count, blocks=False)
        want = traffic(collective, name, schedule.nbytes, size, chunk_bytes=1 << 40)
        assert schedule.busiest() == tuple(want), (size, schedule.busiest(), want)


@pytest.mark.parametrize(("collective", "name"), sorted(PIPELINED))
def test_pipelined_algorithms_cut_blocks_into_chunks(collective: str, name: str) -> None:
    for size in (2, 3, 4, 7, 8):
        count = 64 * size if collective in ("all_reduce", "reduce", "broadcast") else 64
        schedule = record(collective, name, size, count, chunk_bytes=64, blocks=False)
        want = traffic(collective, name, schedule.nbytes, size, chunk_bytes=64)
        assert schedule.busiest() == tuple(want), (size, schedule.busiest(), want)


def test_ring_all_reduce_schedule_step_by_step() -> None:
    """4 ranks, 16 floats: 3 reduce-scatter steps, then 3 all-gather steps, one block per message."""
    schedule = record("all_reduce", "ring", 4, 16)
    assert schedule.steps == 6 and len(schedule.messages) == 24
    for step in range(6):
        moved = sorted((m.src, m.dst, m.block) for m in schedule.messages if m.step == step)
        # rank r sends block (r - step) mod 4 to r + 1 (the gather half continues the same rotation)
        assert moved == [(r, (r + 1) % 4, (r - step - 1) % 4) for r in range(4)], (step, moved)
        assert {m.nbytes for m in schedule.messages if m.step == step} == {16}
    # p-1 combines of a 16-byte block per rank, all in the reduce-scatter half
    assert len(schedule.reductions) == 12 and max(r.step for r in schedule.reductions) == 3


def test_a_direct_algorithm_is_refused() -> None:
    with pytest.raises(ValueError, match="arena"):
        record("all_reduce", "shm", 4, 16)
