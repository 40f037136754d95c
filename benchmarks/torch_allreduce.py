"""dist.all_reduce through the tcoll backend against gloo, in the same run.

    python benchmarks/torch_allreduce.py                 # 2 and 4 ranks, 8 B .. 64 MiB, 3 runs
    python benchmarks/torch_allreduce.py --ranks 2 --sizes 8,65536 --runs 1

Each rank count starts its processes once (torch.multiprocessing, spawn).
The default group is tcoll's; a gloo group of the same ranks is made next to
it (`new_group(backend="gloo")`). Two more tcoll columns: "async" is
async_op=True with TCOLL_TORCH_ASYNC=1, which starts the collective
asynchronously and waits for its Work (the default runs every collective to
completion inside the call); "zero-copy" all-reduces a tensor made by
`tcoll.torch.empty`, in shared memory, which tcoll reads in place. "tcoll vs
gloo" compares the plain "tcoll" column, on an ordinary tensor. "comm.all_reduce" is
tcoll's own call on the default group's communicator, on the same tensor's
memory as a NumPy array, without torch.distributed in the way; "tcoll vs comm"
is what the backend costs on top of it (1.00x: nothing). For every size and backend a run times
`iterations` back-to-back float32 sum all-reduces after a warm-up and a
barrier; the slowest rank's mean is the run's time, and the table shows the
median over the runs. Bus bandwidth is bytes * 2 (n - 1) / n / time, the
figure NCCL's tests print (it compares across rank counts).

DDP training steps: benchmarks/torch_ddp.py.

Set OMP_NUM_THREADS=1 (torchrun does): torch's intra-op threads of several
ranks on a few cores slow every rank down, whatever the backend.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import statistics
import sys
import tempfile
import time
from typing import Any

MODES = ("tcoll", "tcoll-async", "tcoll-zero-copy", "gloo", "comm")
DEFAULT_SIZES = (8, 64 << 10, 1 << 20, 64 << 20)


def _iterations(nbytes: int) -> int:
    """Back-to-back calls per timed run: enough to take ~0.1-1 s at the smallest and a few at 64 MiB."""
    if nbytes <= 1024:
        return 300
    if nbytes <= 256 << 10:
        return 100
    if nbytes <= 4 << 20:
        return 20
    return 3


def _worker(rank: int, size: int, port: int, sizes: list[int], runs: int, out_dir: str) -> None:
    import torch
    import torch.distributed as dist

    import tcoll.torch  # registers the backend (the torch.backends entry point does too)

    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("tcoll", rank=rank, world_size=size, timeout=datetime.timedelta(seconds=600))
    gloo = dist.new_group(list(range(size)), backend="gloo")
    groups = {"tcoll": None, "tcoll-async": None, "tcoll-zero-copy": None, "gloo": gloo, "comm": None}
    times: dict[str, dict[int, list[float]]] = {mode: {n: [] for n in sizes} for mode in MODES}
    for _ in range(runs):
        for nbytes in sizes:
            plain = torch.zeros(max(1, nbytes // 4), dtype=torch.float32)
            shared = tcoll.torch.empty(max(1, nbytes // 4), torch.float32)  # read in place by tcoll
            iterations = _iterations(nbytes)
            for mode in MODES:
                group = groups[mode]
                tensor = shared if mode == "tcoll-zero-copy" else plain
                use_async = mode == "tcoll-async"
                os.environ["TCOLL_TORCH_ASYNC"] = "1" if use_async else "0"
                call = _comm_call(dist, tensor) if mode == "comm" else \
                    (lambda: _all_reduce(dist, tensor, group, use_async))  # noqa: B023 - used in this iteration
                for _ in range(2 if iterations > 3 else 1):  # warm-up
                    call()
                dist.barrier(group=group)
                start = time.perf_counter()
                for _ in range(iterations):
                    call()
                elapsed = torch.tensor([(time.perf_counter() - start) / iterations], dtype=torch.float64)
                dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the slowest rank's mean
                times[mode][nbytes].append(elapsed.item())
    if rank == 0:
        with open(os.path.join(out_dir, f"ranks{size}.json"), "w") as handle:
            json.dump({mode: {str(n): v for n, v in per.items()} for mode, per in times.items()}, handle)
    dist.destroy_process_group()


def _comm_call(dist: Any, tensor: Any) -> Any:
    """tcoll's own all_reduce on the default group's communicator, on the same memory (no torch in the way)."""
    comm, array = dist.group.WORLD.comm, tensor.numpy()
    return lambda: comm.all_reduce(array, "sum")


def _all_reduce(dist: Any, tensor: Any, group: Any, use_async: bool) -> None:
    if use_async:
        dist.all_reduce(tensor, group=group, async_op=True).wait()
    else:
        dist.all_reduce(tensor, group=group)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _size_text(nbytes: int) -> str:
    for unit, shift in (("MiB", 20), ("KiB", 10)):
        if nbytes >= 1 << shift and nbytes % (1 << shift) == 0:
            return f"{nbytes >> shift} {unit}"
    return f"{nbytes} B"


def measure(ranks: int, sizes: list[int], runs: int) -> dict[str, dict[int, float]]:
    """Median seconds per all_reduce, {mode: {nbytes: seconds}}, for `ranks` processes."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as out_dir:
        mp.spawn(_worker, args=(ranks, _free_port(), sizes, runs, out_dir), nprocs=ranks, join=True)
        with open(os.path.join(out_dir, f"ranks{ranks}.json")) as handle:
            raw = json.load(handle)
    return {mode: {int(n): statistics.median(v) for n, v in per.items()} for mode, per in raw.items()}


def table(ranks: int, medians: dict[str, dict[int, float]]) -> str:
    """A Markdown table: latency and bus bandwidth of each mode, and tcoll's speed-up over gloo."""
    lines = [f"{ranks} ranks | tcoll | tcoll busbw | tcoll async | tcoll zero-copy | gloo | gloo busbw | tcoll vs gloo"
             " | comm.all_reduce | tcoll vs comm",
             "---|---:|---:|---:|---:|---:|---:|---:|---:|---:"]
    factor = 2 * (ranks - 1) / ranks
    for nbytes in sorted(medians["tcoll"]):
        t, a, z, g, c = (medians[m][nbytes] for m in MODES)
        nb = max(4, nbytes)
        lines.append(f"{_size_text(nbytes)} | {_time_text(t)} | {_bw_text(nb * factor / t)} | {_time_text(a)} | "
                     f"{_time_text(z)} | {_time_text(g)} | {_bw_text(nb * factor / g)} | {g / t:.1f}x | "
                     f"{_time_text(c)} | {t / c:.2f}x")
    return "\n".join(lines)


def _time_text(seconds: float) -> str:
    if seconds < 1e-3:
        return f"{seconds * 1e6:.1f} us"
    if seconds < 1:
        return f"{seconds * 1e3:.2f} ms"
    return f"{seconds:.2f} s"


def _bw_text(bytes_per_s: float) -> str:
    return f"{bytes_per_s / 1e9:.2f} GB/s" if bytes_per_s >= 1e8 else f"{bytes_per_s / 1e6:.2f} MB/s"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", default="2,4", help="comma-separated rank counts (default 2,4)")
    parser.add_argument("--sizes", default=",".join(map(str, DEFAULT_SIZES)), help="message sizes in bytes")
    parser.add_argument("--runs", type=int, default=3, help="timed runs per size; the median is shown")
    parser.add_argument("--json", help="also write the medians to this file")
    args = parser.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sizes = [int(s) for s in args.sizes.split(",")]
    results = {}
    for ranks in (int(r) for r in args.ranks.split(",")):
        medians = measure(ranks, sizes, args.runs)
        results[ranks] = medians
        print(table(ranks, medians), end="\n\n", flush=True)
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({r: {m: {str(n): t for n, t in per.items()} for m, per in med.items()}
                       for r, med in results.items()}, handle, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
