"""A long wait says so: one line on stderr, once per wait, naming what the rank waits for and on whom.

A wait that outlasts TCOLL_NOTICE seconds (30 by default) is reported once by
each waiting rank, long before its timeout (TCOLL_TIMEOUT, 300 s by default)
ends it: a missing rank, a rank stuck elsewhere, or ranks that joined another
job (a wrong key or run id) show at once who is missing. 0 turns the notices off.
"""

from __future__ import annotations

import os
import sys

__all__ = ["ENV", "notice_after", "say"]

ENV = "TCOLL_NOTICE"


def notice_after() -> float:
    """Seconds of waiting after which a wait is reported (inf: never)."""
    try:
        seconds = float(os.environ.get(ENV, "30"))
    except ValueError:
        seconds = 30.0
    return seconds if seconds > 0 else float("inf")


def say(rank: int, what: str, peers: list[int], waited: float, limit: float) -> None:
    """Print that `rank` has waited `waited` s for `what` on `peers` (and gives up after `limit` s)."""
    shown = peers if len(peers) <= 16 else [*peers[:16], "..."]
    on = f", on rank(s) {', '.join(map(str, shown))}" if peers else ""
    print(f"tcoll: rank {rank} has waited {waited:.0f} s for {what}{on}; it gives up after {limit:g} s "
          f"(TCOLL_TIMEOUT)", file=sys.stderr, flush=True)
