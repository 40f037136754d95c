"""`tcoll bench p2p` measures what it says, on real ranks, and prints a table."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tcoll.bench.cli import format_p2p
from tcoll.bench.p2p import P2PRow, run_p2p, sizes_between

ROOT = Path(__file__).resolve().parents[2]


def test_sizes_between() -> None:
    assert sizes_between(8, 256, 4) == [8, 32, 128, 256]
    assert sizes_between(8, 64 << 20, 4)[-2:] == [32 << 20, 64 << 20]  # -e 64M is measured
    assert sizes_between(8, 8, 4) == [8]
    assert sizes_between(1 << 20, 64 << 20, 4) == [1 << 20, 4 << 20, 16 << 20, 64 << 20]
    with pytest.raises(ValueError):
        sizes_between(0, 8, 2)


@pytest.mark.timeout(180)
def test_run_p2p_measures_both_transports_and_the_reference() -> None:
    rows = run_p2p(["shm", "tcp"], [8, 4096], repeats=1, raw_tcp=True)
    seen = {(row.transport, row.nbytes) for row in rows}
    assert seen == {("shm", 8), ("shm", 4096), ("tcp", 8), ("tcp", 4096), ("raw-tcp-socket", 4096)}
    for row in rows:
        assert row.bandwidth_gbs > 0
        if row.transport != "raw-tcp-socket":
            assert 0 < row.rtt_us < 1e6


def test_table_has_a_line_per_size_and_the_ratio() -> None:
    rows = [P2PRow("shm", 1024, 10.0, 2.0), P2PRow("tcp", 1024, 20.0, 1.0), P2PRow("raw-tcp-socket", 1024,
                                                                                   math.nan, 0.5)]
    table = format_p2p(rows, ["shm", "tcp"], markdown=True).splitlines()
    assert table[0].startswith("| bytes | shm rtt us | shm GB/s | tcp rtt us")
    assert table[2] == "| 1024 | 10.0 | 2.000 | 20.0 | 1.000 | 0.500 | 4.00 |"


@pytest.mark.timeout(180)
def test_cli_prints_the_table() -> None:
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    result = subprocess.run([sys.executable, "-m", "tcoll", "bench", "p2p", "-b", "8", "-e", "64", "-f", "8",
                             "--repeats", "1", "--no-raw-tcp", "--transports", "shm"],
                            env=env, capture_output=True, text=True, timeout=170)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.strip().splitlines()
    assert lines[0].split() == ["bytes", "shm", "rtt", "us", "shm", "GB/s"]
    assert [line.split()[0] for line in lines[1:]] == ["8", "64"]
    assert "# machine:" in result.stderr
