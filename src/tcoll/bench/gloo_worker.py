"""One rank of the gloo compare target: `python -m tcoll.bench.gloo_worker PLAN OUT`.

Started by `tcoll bench --compare gloo` with RANK, WORLD_SIZE, MASTER_ADDR
and MASTER_PORT set. The collectives run on CPU tensors made with
torch.from_numpy from the bench's NumPy buffers, so fill and check see them.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import numpy as np

from .collectives import BenchCase, Buffers, Params
from .sweep import Backend, sweep
from .worker_io import read_plan, write_result


def to_torch(arr: np.ndarray | None) -> Any:
    """A CPU tensor sharing `arr`'s memory (bfloat16 through an int16 view)."""
    import torch

    if arr is None:
        return None
    if arr.dtype.name == "bfloat16":
        return torch.from_numpy(arr.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(arr)


class TorchDistBackend(Backend):
    """What every bench backend on a torch.distributed group shares: its barrier and the sweep's reductions.

    A subclass sets `torch` and `dist` (the modules) and joins the group in its __init__.
    """

    torch: Any
    dist: Any

    def barrier(self) -> None:
        self.dist.barrier()

    def max_all(self, value: float) -> float:
        t = self.torch.tensor([value], dtype=self.torch.float64)
        self.dist.all_reduce(t, self.dist.ReduceOp.MAX)
        return float(t[0])

    def sum_all(self, value: int) -> int:
        t = self.torch.tensor([value], dtype=self.torch.int64)
        self.dist.all_reduce(t, self.dist.ReduceOp.SUM)
        return int(t[0])


class GlooBackend(TorchDistBackend):
    """torch.distributed, backend gloo, on one rank."""

    name = "gloo"
    recoverable = (ValueError, TypeError, NotImplementedError, RuntimeError)
    keeps_input = False  # gloo's reduce uses the non-roots' tensors as scratch (torch leaves them undefined)

    def __init__(self) -> None:
        import torch
        import torch.distributed as dist

        self.torch = torch
        self.dist = dist
        dist.init_process_group("gloo")
        self.rank = dist.get_rank()
        self.size = dist.get_world_size()

    def bind(self, case: BenchCase, bufs: Buffers, p: Params) -> Callable[[], Any]:
        ops = self.dist.ReduceOp
        op = {"sum": ops.SUM, "prod": ops.PRODUCT, "min": ops.MIN, "max": ops.MAX}[p.op]
        return case.gloo(self.dist, Buffers(to_torch(bufs.inp), to_torch(bufs.out)), p, op)

    def info(self) -> dict[str, Any]:
        return {"torch": self.torch.__version__}

    def close(self) -> None:
        self.dist.destroy_process_group()


def serve(backend: TorchDistBackend, plan: dict[str, Any], out: str) -> None:
    """Run `plan` on this rank (rank 0 writes the rows to `out`); the group is closed whatever happens."""
    try:
        rows = sweep(backend, plan)
        if backend.rank == 0:
            write_result(out, {"rows": rows, "info": backend.info()})
        backend.barrier()
    finally:
        backend.close()


def main() -> None:
    warnings.filterwarnings("ignore", category=FutureWarning)
    plan, out = read_plan()
    serve(GlooBackend(), plan, out)


if __name__ == "__main__":
    main()
