"""One rank of the nccl compare target: `python -m tcoll.bench.nccl_worker PLAN OUT`.

Started by `tcoll bench --device cuda --compare nccl` with RANK, WORLD_SIZE,
LOCAL_RANK, MASTER_ADDR and MASTER_PORT set, one rank per GPU (NCCL refuses
two ranks on one GPU; the bench leaves nccl out where ranks outnumber GPUs).
The collectives are torch.distributed's on CUDA tensors copied from the
bench's NumPy buffers (bench.device.CudaBuffers), timed as tcoll's are: a
batch of calls ends with torch.cuda.synchronize().
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from typing import Any

from .collectives import BenchCase, Buffers, Params
from .device import CudaBuffers
from .gloo_worker import TorchDistBackend, serve
from .worker_io import read_plan

__all__ = ["NcclBackend"]


class NcclBackend(TorchDistBackend):
    """torch.distributed, backend nccl, on one rank and its own GPU."""

    name = "nccl"
    recoverable = (ValueError, TypeError, NotImplementedError, RuntimeError)
    keeps_input = False  # torch leaves the non-roots' tensors of a reduce undefined

    def __init__(self) -> None:
        import torch
        import torch.distributed as dist

        self.torch = torch
        self.dist = dist
        self.placement = CudaBuffers(int(os.environ.get("LOCAL_RANK", "0")))
        # device_id binds the group to this rank's GPU (barriers know their device; no guessing warning)
        dist.init_process_group("nccl", device_id=self.placement.device)
        self.rank = dist.get_rank()
        self.size = dist.get_world_size()

    def barrier(self) -> None:
        self.dist.barrier()
        self.torch.cuda.synchronize()

    def max_all(self, value: float) -> float:
        t = self.torch.tensor([value], dtype=self.torch.float64, device=self.placement.device)
        self.dist.all_reduce(t, self.dist.ReduceOp.MAX)
        return float(t[0])  # a copy to host: waits for the all_reduce

    def sum_all(self, value: int) -> int:
        t = self.torch.tensor([value], dtype=self.torch.int64, device=self.placement.device)
        self.dist.all_reduce(t, self.dist.ReduceOp.SUM)
        return int(t[0])

    def bind(self, case: BenchCase, bufs: Buffers, p: Params) -> Callable[[], Any]:
        ops = self.dist.ReduceOp
        op = {"sum": ops.SUM, "prod": ops.PRODUCT, "min": ops.MIN, "max": ops.MAX}[p.op]
        return case.gloo(self.dist, bufs, p, op)  # torch.distributed's calls, on the CUDA tensors

    def info(self) -> dict[str, Any]:
        from .device import nccl_version

        return {"torch": self.torch.__version__, "NCCL": nccl_version(self.torch)}

    def close(self) -> None:
        self.dist.destroy_process_group()


def main() -> None:
    warnings.filterwarnings("ignore", category=FutureWarning)
    plan, out = read_plan()
    serve(NcclBackend(), plan, out)


if __name__ == "__main__":
    main()
