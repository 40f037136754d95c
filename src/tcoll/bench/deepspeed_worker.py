"""One rank of the DeepSpeed compare target: `python -m tcoll.bench.deepspeed_worker PLAN OUT`.

Times DeepSpeed's CPU shared-memory all_reduce: the C++ op
`torch.ops.deepspeed.inference_all_reduce_` that `deepspeed.comm.inference_all_reduce`
runs on CPU (ShareMemCommBuilder's `deepspeed_shm_comm`, JIT-built once with
ninja and g++, then cached under ~/.cache/torch_extensions). The group is set
up the way users get it, `deepspeed.comm.init_distributed("gloo")`, which loads
the op and initialises its shared memory; barriers and the timing reductions
go over gloo.

Started by `tcoll bench --compare deepspeed` with DS_ACCELERATOR=cpu, RANK,
WORLD_SIZE, LOCAL_RANK, LOCAL_SIZE (= WORLD_SIZE, or DeepSpeed never maps its
shared memory), MASTER_ADDR, MASTER_PORT and OMP_NUM_THREADS (cores // ranks,
as DeepSpeed's launcher sets it when it binds cores) set.

The op sums float32, bfloat16 and float16 only, whatever op is asked, and
returns other dtypes unreduced without a word; `deepspeed.comm` falls back to
gloo where the CPU lacks the kernels' ISA. So the bench refuses those calls
(`refusal`), and checks the first call of every measurement against the sum
(`unreduced`): a call that did not really reduce is an error row, never a time.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from .collectives import BenchCase, Buffers, Params, Pattern, count_wrong, layout
from .gloo_worker import TorchDistBackend, serve
from .worker_io import read_plan

__all__ = ["DTYPES", "DeepSpeedBackend", "refusal", "shm_segment", "unreduced"]

# dtype -> the vector_kernel_level its shm kernel needs (DeepSpeed's TorchBackend.inference_all_reduce:
# fp32 uses AVX2, bf16/fp16 AVX-512BW; below that it goes to gloo's all_reduce instead).
DTYPES = {"float32": 1, "bfloat16": 2, "float16": 2}
SHM_PREFIX = "deepspeed_allreduce_buffer"  # shm.cpp's SHM_BUFFER_NAME


def refusal(case: str, dtype: str, op: str, level: int | None = None) -> str | None:
    """Why DeepSpeed's shm op would not really run this call, or None if it would.

    Args:
        case: the collective.
        dtype: the bench dtype name.
        op: the reduction op name.
        level: the op's vector_kernel_level on this CPU (None: not known yet, not checked).
    """
    if case != "all_reduce":
        return f"DeepSpeed's shared-memory op has all_reduce only, not {case}"
    if op != "sum":
        return f"DeepSpeed's shared-memory op sums only (it ignores the op), not {op}"
    if dtype not in DTYPES:
        return f"DeepSpeed's shared-memory op reduces {', '.join(DTYPES)} only (it returns {dtype} unreduced)"
    if level is not None and level < DTYPES[dtype]:
        return (f"this CPU lacks the ISA of DeepSpeed's {dtype} kernel (level {level} < {DTYPES[dtype]}); "
                f"DeepSpeed would run gloo instead")
    return None


def unreduced(case: BenchCase, arr: np.ndarray, p: Params) -> int:
    """Wrong elements of `arr` after one all_reduce of the bench's filled input (this rank)."""
    lay = layout(case, arr.nbytes, p.n, arr.itemsize)
    return count_wrong(case, Buffers(arr, None), Pattern(p.dtype, p.op, p.n), lay, p)


def shm_segment(rank: int, env: Mapping[str, str] = os.environ) -> str:
    """The /dev/shm file DeepSpeed's shm_initialize creates for `rank` (it never unlinks it)."""
    return (f"/dev/shm/{SHM_PREFIX}_{os.getuid()}_{env.get('MASTER_ADDR', '')}_"
            f"{env.get('MASTER_PORT', '')}_{rank}")


class DeepSpeedBackend(TorchDistBackend):
    """deepspeed.comm on CPU, timing its shared-memory inference_all_reduce, on one rank."""

    name = "deepspeed"
    recoverable = (ValueError, TypeError, NotImplementedError, RuntimeError)

    def __init__(self) -> None:
        import torch
        import torch.distributed as dist

        import deepspeed
        from deepspeed.comm import comm as ds_comm  # the module: its `cdb` is set by init_distributed

        self.torch, self.dist, self.version = torch, dist, deepspeed.__version__
        ds_comm.init_distributed(dist_backend="gloo", auto_mpi_discovery=False, verbose=False)
        self.rank = dist.get_rank()
        self.size = dist.get_world_size()
        backend = ds_comm.cdb
        # None: the op could not be built or loaded here (deepspeed.comm then uses gloo for everything)
        self.shm_op = getattr(backend, "shm_comm_op", None)
        self.level = self._level(backend)
        self.local_size = os.environ.get("LOCAL_SIZE")
        self.call = getattr(getattr(torch.ops, "deepspeed", None), "inference_all_reduce_", None)

    def _level(self, backend: Any) -> int | None:
        """The op's vector kernel level on this CPU (None: this DeepSpeed cannot tell; then not checked)."""
        level = getattr(backend, "shm_vector_kernel_level", None)
        if level is None and hasattr(self.shm_op, "vector_kernel_level"):
            level = self.shm_op.vector_kernel_level()
        return None if level is None else int(level)

    def bind(self, case: BenchCase, bufs: Buffers, p: Params) -> Callable[[], Any]:
        """The op on `bufs.inp`, after one call checked on every rank (raises on all ranks alike)."""
        from .gloo_worker import to_torch

        if self.shm_op is None or self.call is None:
            raise NotImplementedError("DeepSpeed's shared-memory op (deepspeed_shm_comm) did not load; see the log")
        if self.local_size != str(self.size):
            raise NotImplementedError(f"LOCAL_SIZE is {self.local_size}, not {self.size}: DeepSpeed would not map "
                                      f"its shared memory")
        why = refusal(case.name, p.dtype.name, p.op, self.level)
        if why:
            raise NotImplementedError(why)
        tensor, op = to_torch(bufs.inp), self.call
        op(tensor)
        wrong = self.sum_all(unreduced(case, bufs.inp, p))
        if wrong:  # every rank sees the sum, so every rank gives up on this measurement together
            raise RuntimeError(f"DeepSpeed's first call left {wrong} elements (over ranks) unreduced: it fell back "
                               f"silently, so it is not timed")
        return lambda: op(tensor)

    def info(self) -> dict[str, Any]:
        return {"deepspeed": self.version, "torch": self.torch.__version__, "op": "inference_all_reduce_ (shm)",
                "vector kernel level": self.level, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "?")}

    def close(self) -> None:
        self.dist.barrier()  # every rank has mapped every segment before it goes
        try:
            os.unlink(shm_segment(self.rank))
        except OSError:
            pass
        self.dist.destroy_process_group()


def main() -> None:
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", r"(overflow|invalid value) encountered", RuntimeWarning)
    plan, out = read_plan()
    serve(DeepSpeedBackend(), plan, out)


if __name__ == "__main__":
    main()
