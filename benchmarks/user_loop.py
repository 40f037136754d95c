"""An all_reduce as a training step uses it: write the buffer, all-reduce it, read the result.

    tcoll run -n 2 benchmarks/user_loop.py
    tcoll run -n 4 benchmarks/user_loop.py --sizes 2M,8M --buffers shm --markdown

`tcoll bench` (as nccl-tests and the OSU benchmarks) calls all_reduce again and again on the same buffer.
Between two such calls nobody touches the buffer, so each core keeps in its cache what it last wrote,
which flatters a schedule in which each rank writes the parts it reduced into the others' buffers. A
program writes its buffer before each call (the gradients) and reads it after (the optimiser): this
times that loop, and the same loop without the call, on plain NumPy arrays and on `comm.empty` buffers.
"call in the loop" is the difference: what the call costs where it is used.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

import tcoll
from tcoll.bench.machine import describe_machine
from tcoll.env import parse_size


def _best(comm: tcoll.Communicator, body, repeats: int, calls: int) -> float:
    """The best of `repeats` averages over `calls` runs of body(), in seconds, slowest rank's."""
    best = float("inf")
    for _ in range(repeats):
        comm.barrier()
        began = time.perf_counter()
        for _ in range(calls):
            body()
        elapsed = np.array([(time.perf_counter() - began) / calls])
        comm.all_reduce(elapsed, op="max")
        best = min(best, float(elapsed[0]))
    return best


def measure(comm: tcoll.Communicator, nbytes: int, buffers: str, repeats: int) -> dict[str, float]:
    """Microseconds of the loop, the loop without the call, and the call alone, for one size and kind."""
    count = nbytes // 4
    x = comm.empty(count, np.float32) if buffers == "shm" else np.empty(count, np.float32)
    fresh = np.full(count, comm.rank + 1, np.float32)
    sink = np.empty(1, np.float64)

    def touch() -> None:
        np.copyto(x, fresh)  # this step's data
        sink[0] = x.sum(dtype=np.float64)  # the result read

    def step() -> None:
        touch()
        comm.all_reduce(x)

    calls = max(5, min(2000, int(2e8 // max(nbytes, 1))))
    step()
    expected = comm.size * (comm.size + 1) / 2
    if not np.all(x == expected):
        raise AssertionError(f"rank {comm.rank}: wrong all_reduce result at {nbytes} bytes ({buffers})")
    loop = _best(comm, step, repeats, calls)
    alone = _best(comm, touch, repeats, calls)
    call = _best(comm, lambda: comm.all_reduce(x), repeats, calls)
    return {"loop": loop * 1e6, "touch": alone * 1e6, "in_loop": (loop - alone) * 1e6, "call": call * 1e6}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="512K,2M,8M,32M", help="comma-separated sizes (K, M, G suffixes)")
    parser.add_argument("--buffers", default="plain,shm", help="plain (NumPy arrays), shm (comm.empty), or both")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--markdown", action="store_true")
    args = parser.parse_args()
    comm = tcoll.init()
    rows = []
    for nbytes in (parse_size(text) for text in args.sizes.split(",")):
        for buffers in args.buffers.split(","):
            rows.append((nbytes, buffers, measure(comm, nbytes, buffers, args.repeats)))
    if comm.rank == 0:
        _print(rows, comm.size, args.markdown)
    comm.barrier()


def _print(rows: list[tuple[int, str, dict[str, float]]], size: int, markdown: bool) -> None:
    print(f"# {describe_machine()} (rank 0's view: a rank may be pinned to one core); {size} ranks; "
          "µs per step, the slowest rank's, best of the repeats")
    head = ["size (B)", "buffers", "write+all_reduce+read", "write+read", "call in the loop", "call alone"]
    if markdown:
        print("| " + " | ".join(head) + " |")
        print("|" + "---|" * len(head))
    else:
        print("  ".join(f"{h:>22}" for h in head))
    for nbytes, buffers, got in rows:
        cells = [str(nbytes), buffers] + [f"{got[key]:.1f}" for key in ("loop", "touch", "in_loop", "call")]
        print("| " + " | ".join(cells) + " |" if markdown else "  ".join(f"{c:>22}" for c in cells))


if __name__ == "__main__":
    main()
