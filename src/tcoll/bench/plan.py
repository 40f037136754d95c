"""What a `tcoll bench` run measures: its configuration, and the plan each implementation's ranks run.

A *plan* (a JSON-able dict, so that mpiexec and torch workers can read it from
a file) lists the sizes and the *jobs*: one job is one case run one way (for
tcoll: one algorithm on one kind of buffer). `measurements` gives the (size,
job) pairs in the order every rank measures them (tcoll.bench.sweep).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

from .collectives import CASES, layout, resolve_dtype

__all__ = ["BenchConfig", "iterations", "warmups", "tcoll_algorithms", "make_jobs", "make_plan", "measurements"]


def iterations(nbytes: int) -> int:
    """Timed calls for a size: many for small sizes, few for large (about 512 MiB moved, 5..1000).

    Small sizes get enough calls that one descheduling of a rank (a few ms on a
    loaded machine) does not decide the mean.
    """
    return max(5, min(1000, (512 << 20) // max(nbytes, 1)))


def warmups(iters: int) -> int:
    """Warm-up calls before `iters` timed ones (2..20)."""
    return max(2, min(20, iters // 5))


@dataclasses.dataclass
class BenchConfig:
    """One `tcoll bench` invocation.

    Attributes:
        cases: collective names (keys of collectives.CASES).
        n: ranks per implementation.
        sizes: benchmark sizes in bytes (nccl-tests' meaning; rounded per case).
        algorithm: tcoll algorithm name, "auto", or "all" (auto and every registered one).
        buffers: "plain" and/or "shm" (tcoll's comm.empty).
        compare: other implementations to run ("gloo", "mpi", "tcoll-mpi", "deepspeed", "nccl"), installed ones
            only.
        device: where every rank's buffers live: "cpu", or "cuda" (torch CUDA tensors, GPU local rank % GPUs).
        iters, warmup: fixed counts instead of the adaptive ones.
        timeout: seconds one implementation's sweep may take.
    """

    cases: list[str]
    n: int = 2
    sizes: list[int] = dataclasses.field(default_factory=lambda: [8])
    dtype: str = "float32"
    op: str = "sum"
    root: int = 0
    algorithm: str = "auto"
    buffers: list[str] = dataclasses.field(default_factory=lambda: ["plain"])
    compare: list[str] = dataclasses.field(default_factory=list)
    repeats: int = 3
    iters: int | None = None
    warmup: int | None = None
    check: bool = False
    timeout: float = 1800.0
    persistent: bool = False  # tcoll also runs each job as a persistent plan (comm.<case>_init)
    floor: bool = True  # all_reduce: the bare-Python floor (bench.floor) in tcoll's processes
    copy: bool = True  # all_reduce: each rank's copy rate at each size (bench.copyrate) in tcoll's processes
    mpiexec: str | None = None  # the MPI launcher for --compare mpi, tcoll-mpi (None: compare.mpiexec finds one)
    device: str = "cpu"


def tcoll_algorithms(case: str, algorithm: str) -> list[str]:
    """The tcoll algorithms a job list sweeps for `case`."""
    if algorithm != "all":
        return [algorithm]
    from ..api import algorithms

    return ["auto", *algorithms(case)]


def make_jobs(config: BenchConfig, impl: str) -> list[dict[str, Any]]:
    """The jobs of one implementation: tcoll has one per case, algorithm and buffer kind."""
    if impl == "tcoll-mpi":  # tcoll's own choice of algorithm, every message over MPI
        return [{"case": case, "label": impl, "algorithm": "auto", "buffers": "plain"} for case in config.cases]
    if impl != "tcoll":
        from .compare import limits

        cases = limits(impl, config.cases, config.dtype, config.op)[0]  # DeepSpeed: all_reduce of float sums
        return [{"case": case, "label": impl, "algorithm": impl, "buffers": "plain"} for case in cases]
    jobs = []
    for case in config.cases:
        for algorithm in tcoll_algorithms(case, config.algorithm):
            for buffers in config.buffers[:1] if case == "barrier" else config.buffers:  # no buffers to place
                for form in ("call", "persistent") if config.persistent else ("call",):
                    jobs.append({"case": case, "label": "tcoll", "algorithm": algorithm, "buffers": buffers,
                                 "form": form})
    return jobs


def make_plan(config: BenchConfig, impl: str, progress: str | None = None) -> dict[str, Any]:
    """The plan an implementation's ranks run (JSON-able)."""
    return {"impl": impl, "n": config.n, "jobs": make_jobs(config, impl), "sizes": list(config.sizes),
            "dtype": config.dtype, "op": config.op, "root": config.root, "iters": config.iters,
            # DeepSpeed is always checked: where it does not reduce it says nothing, and must show as wrong
            "warmup": config.warmup, "check": config.check or impl == "deepspeed", "progress": progress,
            # the floor and the copy rate are host-memory measures: no columns of a CUDA run
            "floor": config.floor and impl == "tcoll" and "all_reduce" in config.cases and config.device == "cpu",
            "copy": config.copy and impl == "tcoll" and "all_reduce" in config.cases and config.device == "cpu",
            "mpiexec": config.mpiexec,
            "device": config.device}


def measurements(plan: dict[str, Any]) -> Iterator[tuple[int, dict[str, Any]]]:
    """(size, job) pairs in the order they are measured: sizes outer, jobs inner.

    A barrier is measured once (at the first size); sizes that round down to no
    element are left out.
    """
    itemsize = resolve_dtype(plan["dtype"]).itemsize
    for index, nbytes in enumerate(plan["sizes"]):
        for job in plan["jobs"]:
            case = CASES[job["case"]]
            if case.name == "barrier":
                if index == 0:
                    yield nbytes, job
            elif layout(case, nbytes, plan["n"], itemsize).count > 0:
                yield nbytes, job
