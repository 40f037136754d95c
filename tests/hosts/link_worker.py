"""A rank that all-reduces in a loop until its job breaks (see test_link_down in tests/hosts).

Usage: link_worker.py OUT_DIR. After a few rounds it writes OUT_DIR/ready<R>;
when a call fails it writes OUT_DIR/rank<R>.json with the error's type, text
and the wall-clock time it was raised.
"""

from __future__ import annotations

import os
import sys
import time

import numpy as np

import tcoll
from helpers.procs import write_json


def main() -> None:
    out_dir = sys.argv[1]
    comm = tcoll.init()
    x = np.ones(256 << 10, dtype=np.float32)  # 1 MiB: data is in flight between hosts most of the time
    result = {"error": None}
    deadline = time.monotonic() + 60
    rounds = 0
    while time.monotonic() < deadline:
        try:
            comm.all_reduce(x, "max")
        except tcoll.TcollError as exc:
            result = {"error": type(exc).__name__, "text": str(exc), "at": time.time()}
            break
        rounds += 1
        if rounds == 5:
            open(os.path.join(out_dir, f"ready{comm.rank}"), "w").close()
    write_json(os.path.join(out_dir, f"rank{comm.rank}.json"), result)  # whole: the test reads it once it exists
    os._exit(0)  # the lost host's ranks will never say goodbye to the store


if __name__ == "__main__":
    main()
