"""A rank that all-reduces across hosts until a host dies, then goes on with the survivors (see tests/hosts).

Usage: survivor_worker.py OUT_DIR. After a few rounds it writes OUT_DIR/ready<R>
(the test then kills a whole host). When a call fails it revokes, shrinks, and
runs every collective on the survivors' communicator against NumPy; it writes
OUT_DIR/rank<R>.json with the error it saw, when, what failed() said, its place
in the new communicator, and the failure of the checks if any.
"""

from __future__ import annotations

import os
import sys
import time
import traceback

import numpy as np

import tcoll
from helpers.procs import write_json
from helpers.survivors import every_collective


def main() -> None:
    out_dir = sys.argv[1]
    comm = tcoll.init()
    x = np.ones(64 << 10, dtype=np.float64)  # 512 KiB: data is in flight between hosts most of the time
    result: dict[str, object] = {"error": None}
    deadline = time.monotonic() + 60
    rounds = 0
    while time.monotonic() < deadline:
        try:
            comm.all_reduce(x, "max")
        except tcoll.TcollError as exc:
            result = {"error": type(exc).__name__, "text": str(exc)[:500], "at": time.time()}
            break
        rounds += 1
        if rounds == 5:
            open(os.path.join(out_dir, f"ready{comm.rank}"), "w").close()
    try:
        comm.revoke()
        result["failed"] = comm.failed()
        new = comm.shrink()
        result["rank"], result["size"] = new.rank, new.size
        every_collective(new, new.all_gather_object(comm.rank))
        result["checks"] = None
    except Exception:  # noqa: BLE001 - written for the test to show
        result["checks"] = traceback.format_exc()
    write_json(os.path.join(out_dir, f"rank{comm.rank}.json"), result)  # whole: the test reads it once it exists
    os._exit(0)  # the dead host's ranks will never say goodbye to the store


if __name__ == "__main__":
    main()
