"""The whole `tcoll bench` run: tcoll and each compare target, one after the other, `repeats` times.

`run_bench` runs tcoll and each compare target in its own set of processes,
one after the other, a whole size sweep at a time, `repeats` times, rotating
the order of the implementations across repeats to spread machine noise.
What is measured is planned in `plan`, timed by `sweep` on every rank (tcoll's
ranks: `tcoll_backend`; the others': `compare` and its workers); `load` adds
background load.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import Any

from ..algos.explaining import format_bytes
from . import BenchError
from .plan import BenchConfig, make_plan, measurements
from .tcoll_backend import run_tcoll

__all__ = ["run_bench"]


def _runners() -> dict[str, Callable[[int, dict[str, Any], float], dict[str, Any]]]:
    from .compare import run_deepspeed, run_gloo, run_mpi, run_nccl, run_tcoll_mpi

    return {"tcoll": run_tcoll, "gloo": run_gloo, "mpi": run_mpi, "tcoll-mpi": run_tcoll_mpi,
            "deepspeed": run_deepspeed, "nccl": run_nccl}


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
