"""Count the Python-level calls of one blocking call: a p2p send+recv pair, an all_reduce, a plan.

    tcoll run -n 2 benchmarks/call_profile.py [--bytes 8] [--calls 2000]

Rank 0 prints, per call, how many Python functions and C builtins cProfile saw (the waits
included: a wait that polls counts its polls), then the most frequent ones. Set
TCOLL_SHM_KERNEL=off to count the paths without the C kernels.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
from collections.abc import Callable

import numpy as np

import tcoll


def profiled(comm: tcoll.Communicator, name: str, call: Callable[[], object], calls: int) -> None:
    """Run `call` `calls` times under cProfile (after as many warm-up calls) and report on rank 0."""
    for _ in range(calls):
        call()
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(calls):
        call()
    profile.disable()
    stats = pstats.Stats(profile).stats  # type: ignore[attr-defined]
    python = sum(entry[1] for key, entry in stats.items() if not key[0].startswith("~"))
    builtins = sum(entry[1] for key, entry in stats.items() if key[0].startswith("~"))
    if comm.rank == 0:
        print(f"{name}: {python / calls:.1f} Python functions and {builtins / calls:.1f} C builtins per call")
        text = io.StringIO()
        pstats.Stats(profile, stream=text).sort_stats("ncalls").print_stats(12)
        print(text.getvalue().split("\n\n", 2)[-1].rstrip())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bytes", type=int, default=8)
    parser.add_argument("--calls", type=int, default=2000)
    args = parser.parse_args()
    comm = tcoll.init()
    peer = 1 - comm.rank if comm.size == 2 else None
    buf = np.zeros(max(1, args.bytes // 4), dtype=np.float32)

    def round_trip() -> None:
        if comm.rank == 0:
            comm.send(buf, peer, 7)
            comm.recv(buf, peer, 7)
        else:
            comm.recv(buf, peer, 7)
            comm.send(buf, peer, 7)

    if peer is not None:
        profiled(comm, "p2p send+recv", round_trip, args.calls)
    profiled(comm, "all_reduce", lambda: comm.all_reduce(buf), args.calls)
    plan = comm.all_reduce_init(buf)
    profiled(comm, "all_reduce plan", plan, args.calls)
    comm.close()


if __name__ == "__main__":
    main()
