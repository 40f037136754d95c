"""A disagreement that shows only after its call still ends the job with an error, never with exit 0.

Two cases over point-to-point, where a rank's part may end before anything
shows it: ranks that disagree on a broadcast's root (each root only sends),
and a root whose broadcast the others meet with an all_reduce. The rank that
has not raised yet raises at a later call, or at close(), which waits for its
peers when its last call only sent; `tcoll run` then exits non-zero.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import tcoll

JOB = textwrap.dedent("""
    import sys
    import numpy as np
    import tcoll

    comm = tcoll.init()
    x = np.full(4, comm.rank + 1.0)
    if sys.argv[1] == "roots":  # ranks 0-2 say root 0, rank 3 says root 3
        comm.broadcast(x, root=3 if comm.rank == 3 else 0)
    elif comm.rank == 0:  # the others call all_reduce: they raise, rank 0 only sent
        comm.broadcast(x, root=0)
    else:
        try:
            comm.all_reduce(x)
        except tcoll.MismatchError:
            pass
    print(f"rank {comm.rank} reached the end")
""")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", ["roots", "root_against_all_reduce"])
@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_the_job_does_not_end_well(tmp_path: Path, transport: str, case: str) -> None:
    script = tmp_path / "job.py"
    script.write_text(JOB)
    env = {**__import__("os").environ, "TCOLL_TRANSPORT": transport}
    done = subprocess.run([sys.executable, "-m", "tcoll", "run", "-n", "4", str(script), case], env=env,
                          capture_output=True, text=True, timeout=100)
    assert done.returncode != 0, done.stdout + done.stderr
    assert "MismatchError" in done.stdout + done.stderr, done.stdout + done.stderr


def root_then(comm: tcoll.Communicator, then: str) -> list[str]:
    """Rank 0 broadcasts while the others all_reduce; then barriers, or close(); what each call said."""
    comm.timeout = 30.0
    seen = []
    for step in ("call", "barrier", "barrier") if then == "barriers" else ("call", "close"):
        try:
            if step == "call":
                x = np.ones(4)
                comm.broadcast(x, root=0) if comm.rank == 0 else comm.all_reduce(x)
            elif step == "barrier":
                comm.barrier()
            else:
                comm.close()
            seen.append("ok")
        except tcoll.TcollError as exc:
            seen.append(f"{type(exc).__name__}: {exc}")
    return seen


def _learns(said: list[str]) -> Any:
    return [s for s in said if s.startswith("MismatchError") and "broadcast #1" in s]


@pytest.mark.timeout(120)
def test_the_root_learns_by_the_call_after_its_first_receiving_one() -> None:
    seen = tcoll.spawn(root_then, 4, ("barriers",), timeout=100, transport="tcp")
    assert seen[0][0] == "ok" and len(_learns(seen[0][1:])) == 1, seen  # barrier #2 or #3 raises it
    for rank in (1, 2, 3):
        assert seen[rank][0].startswith("MismatchError"), seen


@pytest.mark.timeout(120)
def test_the_root_learns_at_close_if_it_makes_no_other_call() -> None:
    seen = tcoll.spawn(root_then, 4, ("close",), timeout=100, transport="tcp")
    assert seen[0][0] == "ok" and seen[0][1].startswith("MismatchError") and "broadcast #1" in seen[0][1], seen


class _QuietEngine:
    """What an Agreement needs of an engine to take notices in (nothing is sent here)."""

    rank, closed = 0, False

    def watch(self, ctx: int, watch: Any) -> None:
        pass


def test_a_disagreement_told_after_a_loss_on_the_same_call_is_the_error_raised() -> None:
    # Rank 0 broadcast (it only sent). Rank 2 tells it that rank 1 is lost; then rank 1's own notice says the
    # ranks disagreed on that very call (rank 1 closed, and was seen lost, before its notice was read).
    from tcoll.algos.stamps import NOTICE
    from tcoll.comm import agreement as module
    from tcoll.p2p.watch import BLOCK_BITS, NOTICE_TAG

    told = module.Agreement(_QuietEngine(), [0, 1, 2], 7, lambda error: None, lambda: None)  # type: ignore[arg-type]
    told.end(told.begin(1, "broadcast", 5, False), sent_only=True)
    tag = (1 << BLOCK_BITS) + NOTICE_TAG
    told._alarm("notice", 2, tag, 9 | NOTICE, module._LOST + module._CAUSE.pack(1) + b"1:connection closed")
    assert isinstance(told.poison, tcoll.PeerLostError)
    said = b"rank 0 called broadcast(root=0) where rank 1 called all_reduce(op=sum)"
    told._alarm("notice", 1, tag, 9 | NOTICE, module._MISMATCH + module._CAUSE.pack(1) + said)
    assert isinstance(told.poison, tcoll.MismatchError) and "all_reduce" in str(told.poison), told.poison
    told._alarm("notice", 2, tag, 9 | NOTICE, module._LOST + module._CAUSE.pack(1) + b"1:connection closed")
    assert isinstance(told.poison, tcoll.MismatchError)  # a later loss does not replace it


class _LateEngine(_QuietEngine):
    """A quiet engine whose polls deliver the notices queued for them, one poll's worth at a time."""

    def __init__(self) -> None:
        self.deliveries: list[list[Any]] = []
        self.agreement: Any = None

    def poll(self) -> None:
        for notice in self.deliveries.pop(0) if self.deliveries else ():
            self.agreement._alarm(*notice)


def test_a_root_that_only_sent_looks_again_once_the_next_call_is_over() -> None:
    # Rank 0 broadcast (it only sent). Its next call began before rank 1's notice came, and ran where no poll
    # happens (the arena, in C): the notice is taken in when that call ends, and the call after it raises.
    from tcoll.algos.stamps import NOTICE
    from tcoll.comm import agreement as module
    from tcoll.p2p.watch import BLOCK_BITS, NOTICE_TAG

    engine = _LateEngine()
    told = module.Agreement(engine, [0, 1, 2], 7, lambda error: None, lambda: None)  # type: ignore[arg-type]
    engine.agreement = told
    told.end(told.begin(1, "broadcast", 5, False), sent_only=True)
    said = b"rank 0 called broadcast(root=0) where rank 1 called all_reduce(op=sum)"
    notice = ("notice", 1, (1 << BLOCK_BITS) + NOTICE_TAG, 9 | NOTICE, module._MISMATCH + module._CAUSE.pack(1) + said)
    engine.deliveries = [[], [notice]]  # nothing yet when call #2 begins; the notice by the time it ends
    barrier = told.begin(2, "barrier", 6, True)
    assert not told.quiet  # (no express call while it looks again)
    told.end(barrier)
    with pytest.raises(tcoll.MismatchError, match="broadcast"):
        told.begin(3, "barrier", 6, True)
