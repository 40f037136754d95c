"""The timing loop every rank of every implementation runs: `sweep` over a plan with a `Backend`.

Per size and job it times the collective as nccl-tests does:

1. buffers made and filled with real data (`collectives.fill`), in host
   memory; the backend's `placement` puts them where the calls run (on the
   CPU: they are the call's buffers; --device cuda: CUDA tensors copied from them);
2. `warmup` calls (the first one tells whether the implementation can run
   the call at all; if not, the row carries the error and shows as "-");
3. a barrier, then `iters` back-to-back calls ended by the placement's
   synchronize (a CUDA call returns before the device is done: the time
   counts the device work); time = elapsed / iters on each rank, then the
   maximum over ranks;
4. with check: the buffers are re-filled, a barrier, one more (untimed) call,
   the result copied to host, and the wrong elements of every rank are
   counted against NumPy and summed.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from . import BenchError
from .collectives import (CASES, BenchCase, Buffers, Params, Pattern, count_wrong, fill, layout, make_buffers,
                          resolve_dtype)
from .plan import iterations, measurements, warmups

__all__ = ["Backend", "HostBuffers", "measure", "sweep"]


class HostBuffers:
    """Where the calls' buffers live on the CPU: the sweep's host arrays themselves (nothing to copy or wait for).

    --device cuda uses bench.device.CudaBuffers instead, with the same four methods.
    """

    def place(self, host: Buffers) -> Buffers:
        """The buffers the calls use, made once from the filled host buffers."""
        return host

    def push(self, host: Buffers, placed: Buffers) -> None:
        """Copy the re-filled host buffers into the placed ones."""

    def pull(self, placed: Buffers, host: Buffers) -> None:
        """Copy the placed buffers' contents into the host ones (to be checked there)."""

    def synchronize(self) -> None:
        """Wait until the calls made so far have finished on the device."""


class Backend:
    """What `sweep` needs from an implementation on one rank."""

    name = "?"
    placement: HostBuffers = HostBuffers()
    rank: int
    size: int
    recoverable: tuple[type[BaseException], ...] = (ValueError, TypeError, NotImplementedError)
    keeps_input = True  # reduce leaves the non-roots' buffers as they were

    def barrier(self) -> None:
        raise NotImplementedError

    def max_all(self, value: float) -> float:
        """The maximum of `value` over ranks (on rank 0 at least)."""
        raise NotImplementedError

    def sum_all(self, value: int) -> int:
        """The sum of `value` over ranks (on rank 0 at least)."""
        raise NotImplementedError

    def allocator(self, job: dict[str, Any]) -> Callable[[tuple[int, ...], np.dtype], Any]:
        """How this job's buffers are made: (shape, dtype) -> NumPy array."""
        return lambda shape, dtype: np.empty(shape, dtype)

    def bind(self, case: BenchCase, bufs: Buffers, p: Params) -> Callable[[], Any]:
        """A function making one call of `case` on `bufs`."""
        raise NotImplementedError

    def info(self) -> dict[str, Any]:
        """Versions and the like, reported by rank 0."""
        return {}


def measure(backend: Backend, job: dict[str, Any], nbytes: int, plan: dict[str, Any]) -> dict[str, Any]:
    """Time one job at one size on this rank; rank 0's row holds the maximum time over ranks."""
    case = CASES[job["case"]]
    dtype = resolve_dtype(plan["dtype"])
    lay = layout(case, nbytes, backend.size, dtype.itemsize)
    p = Params(backend.size, backend.rank, plan["root"], dtype, plan["op"], job["algorithm"], backend.keeps_input)
    pattern = Pattern(dtype, plan["op"] if case.reduces else "sum", backend.size)
    iters = plan["iters"] or iterations(lay.nbytes)
    warm = max(1, warmups(iters) if plan["warmup"] is None else plan["warmup"])
    row = {"case": case.name, "label": job["label"], "algorithm": job["algorithm"], "buffers": job["buffers"],
           "form": job.get("form", "call"), "nbytes": lay.nbytes, "count": lay.count, "dtype": plan["dtype"],
           "op": plan["op"] if case.reduces else "none", "n": backend.size, "iters": iters, "warmup": warm,
           "time": None, "wrong": None, "error": None}
    host = make_buffers(case, lay, p, backend.allocator(job))
    fill(host, pattern, backend.rank)
    placement = backend.placement
    bufs = placement.place(host)
    try:
        call = backend.bind(case, bufs, p, job["form"]) if job.get("form", "call") != "call" else \
            backend.bind(case, bufs, p)
        call()  # the first warm-up call: an implementation that cannot run this call says so here
    except backend.recoverable as exc:
        row["error"] = f"{type(exc).__name__}: {exc}"
        return row
    for _ in range(warm - 1):
        call()
    placement.synchronize()  # the warm-up calls' device work is not timed
    backend.barrier()
    start = time.perf_counter()
    for _ in range(iters):
        call()
    placement.synchronize()
    elapsed = time.perf_counter() - start
    row["time"] = backend.max_all(elapsed / iters)
    if plan["check"] and case.checked is not None:
        fill(host, pattern, backend.rank)
        placement.push(host, bufs)
        placement.synchronize()
        backend.barrier()  # nobody's data may reach a rank still re-filling
        call()
        placement.synchronize()
        placement.pull(bufs, host)
        row["wrong"] = backend.sum_all(count_wrong(case, host, pattern, lay, p))
    return row


def sweep(backend: Backend, plan: dict[str, Any]) -> list[dict[str, Any]]:
    """Run every measurement of the plan on this rank; rank 0's rows are the results.

    Raises:
        BenchError: this implementation's job has another number of ranks than the plan asks for (an
            mpiexec of another MPI than mpi4py's starts n jobs of one rank each: their figures would be
            those of a one-rank call, silently).
    """
    if backend.size != plan["n"]:
        raise BenchError(f"{plan['impl']}: rank {backend.rank} sees {backend.size} rank(s), not the {plan['n']} "
                         "asked for (for mpi: is mpiexec the one of mpi4py's MPI library? see --mpiexec)")
    rows = []
    with contextlib.ExitStack() as stack:
        progress = (stack.enter_context(open(plan["progress"], "a"))
                    if plan.get("progress") and backend.rank == 0 else None)
        for nbytes, job in measurements(plan):
            rows.append(measure(backend, job, nbytes, plan))
            if progress is not None:
                progress.write(".")  # one dot per measurement: the parent's progress bar counts them
                progress.flush()
    return rows
