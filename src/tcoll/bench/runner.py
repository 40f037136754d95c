"""Timing loops and launching: what every rank of every implementation runs, and who starts them.

A *plan* (a JSON-able dict, so that mpiexec and torch workers can read it from
a file) lists the sizes and the *jobs*: one job is one case run one way (for
tcoll: one algorithm on one kind of buffer). Every rank runs `sweep` with a
`Backend` that wraps its implementation; per size and job it times the
collective as nccl-tests does:

1. buffers made and filled with real data (`collectives.fill`);
2. `warmup` calls (the first one tells whether the implementation can run
   the call at all; if not, the row carries the error and shows as "-");
3. a barrier, then `iters` back-to-back calls; time = elapsed / iters on
   each rank, then the maximum over ranks;
4. with check: the buffers are re-filled, a barrier, one more (untimed) call,
   and the wrong elements of every rank are counted against NumPy and summed.

`run_bench` runs tcoll and each compare target in its own set of processes,
one after the other, a whole size sweep at a time, `repeats` times, rotating
the order of the implementations across repeats to spread machine noise.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import subprocess
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from ..algos.explaining import format_bytes
from . import BenchError
from .collectives import (
    CASES,
    BenchCase,
    Buffers,
    Params,
    Pattern,
    count_wrong,
    fill,
    layout,
    make_buffers,
    resolve_dtype,
)

__all__ = ["Backend", "BenchConfig", "BenchError", "LoadGenerator", "iterations", "measurements", "run_bench",
           "sweep", "tcoll_worker", "warmups"]


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
        compare: other implementations to run ("gloo", "mpi", "tcoll-mpi", "deepspeed"), installed ones only.
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
            "floor": config.floor and impl == "tcoll" and "all_reduce" in config.cases,
            "copy": config.copy and impl == "tcoll" and "all_reduce" in config.cases, "mpiexec": config.mpiexec}


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


# -- on every rank ---------------------------------------------------------------------------


class Backend:
    """What `sweep` needs from an implementation on one rank."""

    name = "?"
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
    bufs = make_buffers(case, lay, p, backend.allocator(job))
    fill(bufs, pattern, backend.rank)
    try:
        call = backend.bind(case, bufs, p, job["form"]) if job.get("form", "call") != "call" else \
            backend.bind(case, bufs, p)
        call()  # the first warm-up call: an implementation that cannot run this call says so here
    except backend.recoverable as exc:
        row["error"] = f"{type(exc).__name__}: {exc}"
        return row
    for _ in range(warm - 1):
        call()
    backend.barrier()
    start = time.perf_counter()
    for _ in range(iters):
        call()
    elapsed = time.perf_counter() - start
    row["time"] = backend.max_all(elapsed / iters)
    if plan["check"] and case.checked is not None:
        fill(bufs, pattern, backend.rank)
        backend.barrier()  # nobody's data may reach a rank still re-filling
        call()
        row["wrong"] = backend.sum_all(count_wrong(case, bufs, pattern, lay, p))
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

    def __init__(self, comm: Any) -> None:
        self.comm = comm
        self.rank = comm.rank
        self.size = comm.size

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
        return {"version": __version__, "transports": transports}


def tcoll_worker(comm: Any, plan: dict[str, Any]) -> dict[str, Any] | None:
    """The body of a tcoll rank: sweep the plan; rank 0 returns {"rows": ..., "info": ...}."""
    # In-place sums repeated iters times overflow to inf (as they do in gloo and MPI, silently);
    # the reductions may run on tcoll's own threads, so this is a process-wide filter, not np.seterr.
    warnings.filterwarnings("ignore", r"(overflow|invalid value) encountered", RuntimeWarning)
    backend = TcollBackend(comm)
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
    """Sweep the plan on n tcoll rank processes (tcoll.spawn; tcoll picks shm on one host)."""
    from ..errors import SpawnError, TimeoutError
    from ..startup.spawn import spawn

    try:
        return spawn(tcoll_worker, n, (plan,), timeout=timeout)[0]
    except (SpawnError, TimeoutError) as exc:
        raise BenchError(f"tcoll ranks failed: {exc}") from exc


# -- background load ---------------------------------------------------------------------------

LOAD_MARKER = "tcoll-bench-load"
# A tight loop that also ends when its parent goes (checked every ~10 ms), so that a bench
# killed with SIGKILL leaves no spinning process behind.
_LOAD_CODE = ("import os\nparent = os.getppid()\nwhile os.getppid() == parent:\n"
              "    for _ in range(100000):\n        pass\n")


class LoadGenerator:
    """K busy processes (not niced: they compete like another job) for the life of a `with` block."""

    def __init__(self, count: int) -> None:
        self.count = count
        self.procs: list[subprocess.Popen[bytes]] = []

    def __enter__(self) -> LoadGenerator:
        try:
            for _ in range(self.count):
                self.procs.append(subprocess.Popen([sys.executable, "-c", _LOAD_CODE, LOAD_MARKER],
                                                   stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL))
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        """Kill and reap every load process (idempotent)."""
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
        for proc in self.procs:
            proc.wait()
        self.procs = []


# -- the whole run -----------------------------------------------------------------------------


def _runners() -> dict[str, Callable[[int, dict[str, Any], float], dict[str, Any]]]:
    from .compare import run_deepspeed, run_gloo, run_mpi, run_tcoll_mpi

    return {"tcoll": run_tcoll, "gloo": run_gloo, "mpi": run_mpi, "tcoll-mpi": run_tcoll_mpi,
            "deepspeed": run_deepspeed}


def run_bench(config: BenchConfig, progress: Any = None,
              note: Callable[[str], None] = lambda text: print(text, file=sys.stderr)) -> dict[str, Any]:
    """Run tcoll and every compare target `repeats` times.

    Args:
        progress: a report.Progress (start, watch, drop, close); None: no progress.
        note: where remarks go (a compare target that failed and was dropped).

    Returns:
        {"samples": one row per measurement per repeat, tagged "impl" and "repeat";
         "info": {impl: what its rank 0 reported}}.

    Raises:
        BenchError: tcoll's ranks failed.
    """
    import tempfile

    impls = ["tcoll", *config.compare]
    counts = {impl: sum(1 for _ in measurements(make_plan(config, impl))) for impl in impls}
    if progress is not None:
        progress.start(config.repeats * sum(counts.values()))
    samples: list[dict[str, Any]] = []
    info: dict[str, Any] = {}
    try:
        with tempfile.TemporaryDirectory(prefix="tcoll-bench-") as tmp:
            for repeat in range(config.repeats):
                shift = repeat % len(impls)
                for impl in impls[shift:] + impls[:shift]:
                    if impl in impls:  # not dropped after a failure
                        _run_one(config, impl, repeat, os.path.join(tmp, f"progress-{impl}-{repeat}"), progress,
                                 samples, info, impls, counts[impl], note)
    finally:
        if progress is not None:
            progress.close()
    return {"samples": samples, "info": info}


def _run_one(config: BenchConfig, impl: str, repeat: int, path: str, progress: Any, samples: list[dict[str, Any]],
             info: dict[str, Any], impls: list[str], count: int, note: Callable[[str], None]) -> None:
    """One sweep of one implementation; a compare target that fails is noted and removed from `impls`."""
    plan = make_plan(config, impl, path)
    names = [f"{job['case']} {format_bytes(nbytes)}" for nbytes, job in measurements(plan)]
    watch = progress.watch(path, f"{impl} {repeat + 1}/{config.repeats}", names) if progress is not None else None
    try:
        result = _runners()[impl](config.n, plan, config.timeout)
    except BenchError as exc:
        if impl == "tcoll":
            raise
        note(f"# compare: {impl} failed and is left out: {exc}")
        impls.remove(impl)
        if watch is not None:
            progress.drop(count * (config.repeats - repeat) - watch.close())
        return
    finally:
        if watch is not None:
            watch.close()
    info[impl] = result.get("info", {})
    samples.extend(dict(row, impl=row.get("impl", impl), repeat=repeat) for row in result["rows"])

