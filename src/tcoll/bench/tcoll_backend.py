"""tcoll's side of `tcoll bench`: its Backend, the body of its ranks, and the floor and copy rows beside it."""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np

from . import BenchError
from .collectives import CASES, BenchCase, Buffers, Params, layout, resolve_dtype
from .plan import iterations
from .sweep import Backend, HostBuffers, sweep

__all__ = ["TcollBackend", "tcoll_worker", "floor_rows", "copy_rows", "run_tcoll"]


class _PlanMaker:
    """Stands in for a communicator in a case's call: the call makes the collective's plan instead."""

    def __init__(self, comm: Any) -> None:
        self.comm, self.plan = comm, None

    def __getattr__(self, name: str) -> Callable[..., None]:
        def make(*args: Any, **kwargs: Any) -> None:
            self.plan = getattr(self.comm, f"{name}_init")(*args, **kwargs)

        return make


class TcollBackend(Backend):
    """tcoll on one rank of a `tcoll.spawn`."""

    name = "tcoll"

    def __init__(self, comm: Any, placement: HostBuffers | None = None) -> None:
        self.comm = comm
        self.rank = comm.rank
        self.size = comm.size
        if placement is not None:  # --device cuda: bench.device.CudaBuffers
            self.placement = placement

    def barrier(self) -> None:
        self.comm.barrier()

    def max_all(self, value: float) -> float:
        return float(self.comm.all_reduce(np.array([value], dtype=np.float64), "max")[0])

    def sum_all(self, value: int) -> int:
        return int(self.comm.all_reduce(np.array([value], dtype=np.int64), "sum")[0])

    def allocator(self, job: dict[str, Any]) -> Callable[[tuple[int, ...], np.dtype], Any]:
        if job["buffers"] == "shm":
            return lambda shape, dtype: self.comm.empty(shape, dtype)
        return super().allocator(job)

    def bind(self, case: BenchCase, bufs: Buffers, p: Params, form: str = "call") -> Callable[[], Any]:
        if form == "persistent":  # the case's call, made once through comm.<case>_init: its plan runs it
            maker = _PlanMaker(self.comm)
            case.tcoll(maker, bufs, p, p.op)()
            return maker.plan
        return case.tcoll(self.comm, bufs, p, p.op)

    def info(self) -> dict[str, Any]:
        from .. import __version__

        transports = sorted({self.comm.transport(r) for r in range(self.size) if r != self.rank})
        found: dict[str, Any] = {"version": __version__, "transports": transports}
        if not isinstance(self.placement, HostBuffers):  # CUDA buffers: how the user asked tcoll to move them
            found["TCOLL_GPU"] = os.environ.get("TCOLL_GPU", "unset (auto)")
        return found


def tcoll_worker(comm: Any, plan: dict[str, Any], placement: HostBuffers | None = None) -> dict[str, Any] | None:
    """The body of a tcoll rank: sweep the plan; rank 0 returns {"rows": ..., "info": ...}.

    Args:
        placement: where the calls' buffers live (None: host memory; bench.tcoll_cuda passes CUDA's).
    """
    # In-place sums repeated iters times overflow to inf (as they do in gloo and MPI, silently);
    # the reductions may run on tcoll's own threads, so this is a process-wide filter, not np.seterr.
    warnings.filterwarnings("ignore", r"(overflow|invalid value) encountered", RuntimeWarning)
    backend = TcollBackend(comm, placement)
    rows = sweep(backend, plan)
    if plan.get("floor"):
        rows += floor_rows(comm, plan)
    if plan.get("copy"):
        rows += copy_rows(comm, plan)
    return {"rows": rows, "info": backend.info()} if comm.rank == 0 else None


def floor_rows(comm: Any, plan: dict[str, Any]) -> list[dict[str, Any]]:
    """The bare-Python floor of all_reduce (sum) at each size up to FLOOR_BYTES, in tcoll's rank processes."""
    from .floor import FLOOR_BYTES, FloorSegment, measure_floor

    dtype = resolve_dtype(plan["dtype"])
    sizes = [n for n in plan["sizes"] if dtype.itemsize <= n <= FLOOR_BYTES]
    if not sizes or comm.size < 2:
        return []
    segment = FloorSegment(comm, max(sizes))
    rows = []
    try:
        for nbytes in sizes:
            count = nbytes // dtype.itemsize
            buf = np.ones(count, dtype)
            iters = plan["iters"] or iterations(count * dtype.itemsize)
            seconds = measure_floor(comm, "all_reduce", buf, iters, segment)
            rows.append({"case": "all_reduce", "label": "floor", "algorithm": "floor", "buffers": "plain",
                         "form": "call", "nbytes": count * dtype.itemsize, "count": count, "dtype": plan["dtype"],
                         "op": plan["op"], "n": comm.size, "iters": iters, "warmup": iters // 10, "time": seconds,
                         "wrong": None, "error": None, "impl": "floor"})
    finally:
        segment.close()
    return rows


def copy_rows(comm: Any, plan: dict[str, Any]) -> list[dict[str, Any]]:
    """Each rank's copy time (bench.copyrate) at each all_reduce size, every rank copying at once."""
    from .copyrate import copy_seconds

    dtype = resolve_dtype(plan["dtype"])
    rows = []
    for nbytes in plan["sizes"]:
        lay = layout(CASES["all_reduce"], nbytes, comm.size, dtype.itemsize)
        if lay.count == 0:
            continue
        iters = plan["iters"] or iterations(lay.nbytes)
        rows.append({"case": "all_reduce", "label": "copy", "algorithm": "copy", "buffers": "plain", "form": "call",
                     "nbytes": lay.nbytes, "count": lay.count, "dtype": plan["dtype"], "op": plan["op"],
                     "n": comm.size, "iters": iters, "warmup": max(1, iters // 10),
                     "time": copy_seconds(comm, lay.nbytes, iters), "wrong": None, "error": None, "impl": "copy"})
    return rows


def run_tcoll(n: int, plan: dict[str, Any], timeout: float) -> dict[str, Any]:
    """Sweep the plan on n tcoll rank processes (tcoll.spawn; tcoll picks shm on one host).

    With plan["device"] "cuda" the ranks run bench.tcoll_cuda's worker on CUDA buffers, and see the
    TCOLL_GPU the user set (none set: tcoll's default).
    """
    from ..errors import SpawnError, TimeoutError
    from ..startup.spawn import spawn

    worker: Callable[..., Any] = tcoll_worker
    env = {}
    if plan.get("device") == "cuda":
        from .tcoll_cuda import tcoll_cuda_worker

        worker = tcoll_cuda_worker
        if "TCOLL_GPU" in os.environ:
            env["TCOLL_GPU"] = os.environ["TCOLL_GPU"]
    try:
        return spawn(worker, n, (plan,), timeout=timeout, env=env)[0]
    except (SpawnError, TimeoutError) as exc:
        raise BenchError(f"tcoll ranks failed: {exc}") from exc
