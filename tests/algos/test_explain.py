"""`tcoll explain` and `tcoll.explain`: every eligible algorithm with time, messages and bytes, the choice, why."""

from __future__ import annotations

import time

import pytest

import tcoll
from tcoll import cli
from tcoll.algos.registry import COLLECTIVES, REGISTRY
from tcoll.algos.select import COSTS, choose


def _rows(text: str) -> list[list[str]]:
    return [line.split() for line in text.splitlines()[2:-1]]


def test_the_table_marks_the_choice_and_says_why() -> None:
    text = tcoll.explain("all_reduce", "64MiB", 1024, "tcp")
    lines = text.splitlines()
    assert lines[0].startswith("all_reduce, 64 MiB per rank, 1024 ranks over tcp")
    rows = _rows(text)
    assert [row[0] for row in rows].count("*") == 1 and rows[0][0] == "*"
    assert rows[0][1] == choose("all_reduce", 64 << 20, 1024, COSTS["tcp"]).name == "rabenseifner"
    one_host = {name for name, info in REGISTRY["all_reduce"].items() if not info.direct and not info.hierarchical}
    assert {row[1] if row[0] == "*" else row[0] for row in rows} == one_host
    ring = next(row for row in rows if row[0] == "ring")
    assert ring[3:6] == ["2046", "127.9", "MiB"]  # 2(p-1) messages of 64 KiB blocks, 2n(p-1)/p bytes
    assert lines[-1].startswith("why: rabenseifner") and "latencies" in lines[-1]


def test_one_host_blocking_calls_weigh_the_direct_algorithms() -> None:
    assert _rows(tcoll.explain("all_reduce", 8, 4))[0][:2] == ["*", "shm"]
    for text in (tcoll.explain("all_reduce", 8, 4, blocking=False), tcoll.explain("all_reduce", 8, 4, hosts=2)):
        assert "shm" not in [row[1] if row[0] == "*" else row[0] for row in _rows(text)]
    assert "over tcp on 2 hosts" in tcoll.explain("all_reduce", 8, 4, hosts=2)


def test_a_million_ranks_at_once() -> None:
    began = time.perf_counter()
    for collective in COLLECTIVES:
        if tcoll.algorithms(collective) == ["shm"]:
            continue  # (all_to_allv's one algorithm) runs only inside a host
        assert "why:" in tcoll.explain(collective, "1G", 1_000_000, "tcp")
    assert time.perf_counter() - began < 2.0  # closed forms only: microseconds each, even on a loaded machine


@pytest.mark.parametrize(("size", "shown"), [("8", "8 B"), ("64MiB", "64 MiB"), ("1G", "1 GiB"), ("256K", "256 KiB")])
def test_the_command_reads_sizes_as_people_write_them(capsys: pytest.CaptureFixture[str], size: str,
                                                      shown: str) -> None:
    assert cli.main(["explain", "all_reduce", size, "-n", "8", "--transport", "tcp"]) == 0
    assert capsys.readouterr().out.startswith(f"all_reduce, {shown} per rank, 8 ranks over tcp")


def test_the_command_refuses_nonsense(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["explain", "all_reduce", "6x", "-n", "8"]) == 2
    assert "not a byte size" in capsys.readouterr().err
    assert cli.main(["explain", "all_reduce", "8", "-n", "0"]) == 2
    assert cli.main(["explain", "nonsense", "8"]) == 2
