"""Small repeated torch.distributed calls on the tcoll backend and on gloo: microseconds per call.

    python benchmarks/torch_small_calls.py                   # tcoll, then gloo, 2 ranks, 8-byte tensors
    python benchmarks/torch_small_calls.py --backends tcoll --ranks 4 --elements 256

Each backend's ranks start once (torch.multiprocessing, spawn) and call, on the
same tensors each time, dist.all_reduce, dist.broadcast, dist.reduce,
dist.all_gather_into_tensor, dist.reduce_scatter_tensor, dist.all_to_all_single
and dist.all_gather (into a list of tensors): 500 calls to warm up, then --calls timed; each line
is the slower rank's mean. The results are checked once at the end.
Set OMP_NUM_THREADS=1 (done here if unset).
"""

from __future__ import annotations

import argparse
import datetime
import os
import socket
import sys
import time
import warnings

CALLS = ("all_reduce", "broadcast", "reduce", "all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single",
         "all_gather")


def _worker(rank: int, size: int, port: int, backend: str, elements: int, calls: int) -> None:
    import torch
    import torch.distributed as dist

    import tcoll.torch  # noqa: F401 - registers the backend

    warnings.filterwarnings("ignore", category=FutureWarning)  # (torch renamed the *_tensor calls)
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group(backend, rank=rank, world_size=size, timeout=datetime.timedelta(seconds=120))
    x, gathered = torch.full((elements,), float(rank)), torch.empty(elements * size)
    parts, part, summed = torch.ones(elements * size), torch.empty(elements), torch.ones(elements)
    run = {"all_reduce": lambda: dist.all_reduce(summed),
           "all_gather_into_tensor": lambda: dist.all_gather_into_tensor(gathered, x),
           "reduce_scatter_tensor": lambda: dist.reduce_scatter_tensor(part, parts),
           "all_gather": lambda: dist.all_gather(rows, x), "broadcast": lambda: dist.broadcast(summed, 0),
           "reduce": lambda: dist.reduce(summed, 0), "all_to_all_single": lambda: dist.all_to_all_single(swapped, parts)}
    swapped = torch.empty(elements * size)
    rows = [torch.empty(elements) for _ in range(size)]
    for name in CALLS:
        for _ in range(500):
            run[name]()
        dist.barrier()
        start = time.perf_counter()
        for _ in range(calls):
            run[name]()
        spent = torch.tensor([(time.perf_counter() - start) / calls])
        dist.all_reduce(spent, op=dist.ReduceOp.MAX)
        if rank == 0:
            print(f"{backend:6s} {size} ranks {name:24s} {spent.item() * 1e6:8.1f} us", flush=True)
    assert torch.equal(gathered, torch.arange(size, dtype=torch.float32).repeat_interleave(elements))
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backends", default="tcoll,gloo", help="comma-separated (default tcoll,gloo)")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--elements", type=int, default=2, help="float32 elements per rank (default 2: 8 bytes)")
    parser.add_argument("--calls", type=int, default=5000, help="timed calls of each kind")
    args = parser.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch.multiprocessing as mp

    for backend in args.backends.split(","):
        mp.spawn(_worker, args=(args.ranks, _free_port(), backend, args.elements, args.calls), nprocs=args.ranks)
    return 0


if __name__ == "__main__":
    sys.exit(main())
