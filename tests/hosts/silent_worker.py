"""Rank 0 waits to receive from rank 1, whose host is then cut off (see test_a_vanished_host in tests/hosts).

Usage: silent_worker.py OUT_DIR. Every rank writes OUT_DIR/ready<R> once the
ranks have met; rank 0 then blocks in a receive from rank 1, which never sends,
and writes OUT_DIR/rank0.json with the error it gets (type, text, wall-clock
time). Rank 1 waits until it is stopped.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

import numpy as np

import tcoll


def main() -> None:
    out_dir = sys.argv[1]
    comm = tcoll.init()
    comm.barrier()
    open(os.path.join(out_dir, f"ready{comm.rank}"), "w").close()
    if comm.rank != 0:
        signal.pause()
        return
    try:
        comm.recv(np.zeros(4), src=1, tag=3)  # idle connection: only keep-alive can tell the peer is gone
        result = {"error": None, "text": "the receive completed", "at": time.time()}
    except tcoll.TcollError as exc:
        result = {"error": type(exc).__name__, "text": str(exc), "at": time.time()}
    with open(os.path.join(out_dir, "rank0.json.tmp"), "w") as handle:
        json.dump(result, handle)
    os.rename(os.path.join(out_dir, "rank0.json.tmp"), os.path.join(out_dir, "rank0.json"))
    os._exit(0)  # rank 1 will never say goodbye


if __name__ == "__main__":
    main()
