"""A rank that dies while the ranks meet is named by the survivors within seconds, not after the timeout."""

from __future__ import annotations

import os
import textwrap
import time
from pathlib import Path

import pytest

from helpers.procs import run_ranks


# Rank 2 dies by SIGKILL at a chosen point of its init: before its card is out, or while connecting.
_JOB = """
    import json, os, signal, sys, time
    import tcoll
    from tcoll.startup import connect
    from tcoll.transport.shm.transport import ShmTransport
    from tcoll.transport.tcp.transport import TcpTransport

    rank, where = int(os.environ["TCOLL_RANK"]), sys.argv[1]

    def die(*args, **kwargs):
        open(f"died.{rank}", "w").write(repr(time.time()))
        os.kill(os.getpid(), signal.SIGKILL)

    if rank == 2 and where == "cards":
        connect.exchange_cards = die
    if rank == 2 and where == "connect":
        ShmTransport.connect = TcpTransport.connect = die
    if rank == 1 and where == "segment":  # its rings go before rank 0 maps them, as when its setup fails
        import tcoll.transport.shm.transport as shm
        made = shm.new_segment

        def let_go_at_once(*args, **kwargs):
            segment = made(*args, **kwargs)
            segment.unlink()
            return segment

        shm.new_segment = let_go_at_once
    start = time.time()
    try:
        tcoll.init(timeout=60)
        result = {"error": None}
    except Exception as exc:
        result = {"error": f"{type(exc).__name__}: {exc}", "at": time.time()}
    open(f"result.{rank}", "w").write(json.dumps(result))
"""


@pytest.mark.timeout(60)
@pytest.mark.parametrize("transport", ["shm", "tcp"])
@pytest.mark.parametrize("where", ["cards", "connect"])
def test_a_rank_killed_during_init_is_named_within_5_s(tmp_path: Path, transport: str, where: str) -> None:
    import json

    (tmp_path / "job.py").write_text(textwrap.dedent(_JOB))
    run_ranks(tmp_path, ["job.py", where], 3, f"death{os.getpid()}", TCOLL_TRANSPORT=transport)
    died = float((tmp_path / "died.2").read_text())
    for rank in (0, 1):
        result = json.loads((tmp_path / f"result.{rank}").read_text())
        assert result["error"] and "rank 2" in result["error"] and "died" in result["error"], result
        assert result["at"] - died < 5.0, f"rank {rank} took {result['at'] - died:.1f} s to notice"
    assert time.time() - died < 30


@pytest.mark.timeout(60)
def test_a_rank_whose_rings_are_gone_is_named(tmp_path: Path) -> None:
    """A peer's shm segment that vanished before this rank mapped it names that peer, not just a /proc path."""
    import json

    (tmp_path / "job.py").write_text(textwrap.dedent(_JOB))
    # Two ranks: rank 1 stays in its own wait until rank 0 has tried its rings (and, failing, left).
    run_ranks(tmp_path, ["job.py", "segment"], 2, f"gone{os.getpid()}", TCOLL_TRANSPORT="shm")
    error = json.loads((tmp_path / "result.0").read_text())["error"]
    assert error and "rank 1's shared memory" in error and "rank 1 stopped meeting" in error, error
