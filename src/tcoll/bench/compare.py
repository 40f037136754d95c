"""The compare targets: torch.distributed with gloo or NCCL, mpi4py with MPICH, and DeepSpeed's CPU shm all_reduce.

Each runs the same plan as tcoll (`sweep.sweep`) in its own processes:
gloo as n `python -m tcoll.bench.gloo_worker` subprocesses meeting at
127.0.0.1 on a free port; NCCL (--device cuda) the same way with
`python -m tcoll.bench.nccl_worker`, on CUDA tensors, a GPU per rank; MPI as `mpiexec -n N python -m tcoll.bench.mpi_worker`.
tcoll itself over its MPI engine ("tcoll-mpi") as `mpiexec -n N python -m
tcoll.bench.tcoll_mpi_worker` with TCOLL_TRANSPORT=mpi. DeepSpeed as n
`python -m tcoll.bench.deepspeed_worker` subprocesses like gloo's, with
DS_ACCELERATOR=cpu and LOCAL_SIZE=n (all_reduce of float sums only: `limits`).
The plan goes in a JSON file; rank 0 writes its rows to another.
A target that is not installed is skipped with a note, never an error.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import importlib.util
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from . import BenchError

__all__ = ["TARGETS", "limits", "missing", "mpiexec", "run_deepspeed", "run_gloo", "run_mpi", "run_nccl",
           "run_tcoll_mpi", "versions"]

TARGETS = ("gloo", "mpi", "tcoll-mpi", "deepspeed", "nccl")
_HINT = "pip install tcoll[compare]"
_DS_HINT = "pip install tcoll[deepspeed]"


def mpiexec() -> str | None:
    """The mpiexec next to this Python (MPICH from PyPI installs it there), else the one on PATH."""
    beside = Path(sys.executable).parent / "mpiexec"
    if beside.exists():
        return str(beside)
    return shutil.which("mpiexec")


def missing(target: str) -> str | None:
    """Why `target` cannot run here, or None if it can."""
    if target == "gloo":
        if importlib.util.find_spec("torch") is None:
            return f"torch is not installed ({_HINT})"
        return None
    if target == "nccl":
        if importlib.util.find_spec("torch") is None:
            return "torch is not installed"
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_nccl_available():
            return "this torch has no NCCL (torch.distributed.is_nccl_available() is false)"
        return None
    if target in ("mpi", "tcoll-mpi"):
        if importlib.util.find_spec("mpi4py") is None:
            return f"mpi4py is not installed ({_HINT})"
        if mpiexec() is None:
            return f"no mpiexec found ({_HINT} installs MPICH's)"
        return None
    if target == "deepspeed":
        if importlib.util.find_spec("deepspeed") is None:
            return f"deepspeed is not installed ({_DS_HINT})"
        if importlib.util.find_spec("torch") is None:
            return f"torch is not installed ({_DS_HINT})"
        if not sys.platform.startswith("linux"):
            return "DeepSpeed's shared-memory all_reduce is Linux only"
        if not any(shutil.which(cc) for cc in ("c++", "g++")):
            return "no C++ compiler found (DeepSpeed builds its shared-memory op on first use)"
        return None
    return f"unknown compare target (choose from {', '.join(TARGETS)})"


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def versions(targets: list[str]) -> dict[str, str]:
    """Versions of tcoll and the compare targets, without importing them (cheap)."""
    from .. import __version__

    found = {"tcoll": __version__}
    if "gloo" in targets or "nccl" in targets:
        found["torch"] = _version("torch") or "?"
    if "mpi" in targets or "tcoll-mpi" in targets:
        found["mpi4py"] = _version("mpi4py") or "?"
        mpich = _version("mpich")
        found["mpi library"] = f"MPICH {mpich} (PyPI)" if mpich else "the MPI library mpi4py finds"
    if "deepspeed" in targets:
        found["deepspeed"] = _version("deepspeed") or "?"
    return found


def limits(target: str, cases: list[str], dtype: str, op: str) -> tuple[list[str], str | None]:
    """The cases `target` really runs with this dtype and op, and why it runs no other.

    Only DeepSpeed is limited: its shared-memory op all-reduces float sums, and
    silently returns anything else unreduced, so those calls are never timed.

    Returns:
        (cases it runs, a note on those it does not, or None).
    """
    if target != "deepspeed":
        return list(cases), None
    from .deepspeed_worker import refusal

    kept = [case for case in cases if refusal(case, dtype, op) is None]
    left = [case for case in cases if case not in kept]
    if not left:
        return kept, None
    return kept, f"{', '.join(left)} left out: {refusal(left[0], dtype, op)}"


def _env() -> dict[str, str]:
    """The environment of worker processes: this tcoll importable, quiet warnings."""
    src = str(Path(__file__).resolve().parent.parent.parent)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (src, env.get("PYTHONPATH", "")) if p)
    env.setdefault("PYTHONWARNINGS", "ignore::FutureWarning")
    return env


def _cores() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _tail(path: str, lines: int = 15) -> str:
    try:
        with open(path, errors="replace") as handle:
            return "".join(handle.readlines()[-lines:]).rstrip()
    except OSError:
        return ""


def _wait_all(procs: list[subprocess.Popen[bytes]], timeout: float) -> None:
    """Wait for every process; on a failure or the deadline kill the rest. Raises BenchError."""
    deadline = time.monotonic() + timeout
    pending = list(procs)
    while pending:
        for proc in list(pending):
            code = proc.poll()
            if code is None:
                continue
            pending.remove(proc)
            if code != 0:
                raise BenchError(f"a rank process exited with code {code}")
        if pending:
            if time.monotonic() > deadline:
                raise BenchError(f"did not finish within {timeout:.0f} s")
            try:
                pending[0].wait(0.05)
            except subprocess.TimeoutExpired:
                pass


def _kill(procs: list[subprocess.Popen[bytes]]) -> None:
    """Kill each process's group (each was started in its own session) and reap it."""
    for proc in procs:
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                proc.kill()
    for proc in procs:
        proc.wait()


def _launch(target: str, commands: list[tuple[list[str], dict[str, str]]], plan: dict[str, Any],
            timeout: float) -> dict[str, Any]:
    """Run the commands (plan file and output file appended), wait, read rank 0's output."""
    with tempfile.TemporaryDirectory(prefix=f"tcoll-bench-{target}-") as tmp:
        plan_path, out_path, log_path = (os.path.join(tmp, name) for name in ("plan.json", "out.json", "log"))
        with open(plan_path, "w") as handle:
            json.dump(plan, handle)
        procs: list[subprocess.Popen[bytes]] = []
        try:
            with open(log_path, "wb") as log:
                for command, env in commands:
                    procs.append(subprocess.Popen([*command, plan_path, out_path], env=env, stdin=subprocess.DEVNULL,
                                                  stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
                _wait_all(procs, timeout)
        except BenchError as exc:
            raise BenchError(f"{target}: {exc}\n{_tail(log_path)}") from None
        finally:
            _kill(procs)
        try:
            with open(out_path) as handle:
                return json.load(handle)
        except (OSError, ValueError) as exc:
            raise BenchError(f"{target}: rank 0 wrote no results ({exc})\n{_tail(log_path)}") from None


def run_gloo(n: int, plan: dict[str, Any], timeout: float) -> dict[str, Any]:
    """Sweep the plan with torch.distributed (gloo, CPU tensors) on n subprocesses."""
    return _run_torch("gloo", n, plan, timeout)


def run_nccl(n: int, plan: dict[str, Any], timeout: float) -> dict[str, Any]:
    """Sweep the plan with torch.distributed (NCCL, CUDA tensors, a GPU per rank) on n subprocesses."""
    return _run_torch("nccl", n, plan, timeout)


def _run_torch(backend: str, n: int, plan: dict[str, Any], timeout: float) -> dict[str, Any]:
    """Sweep the plan with `tcoll.bench.<backend>_worker` on n subprocesses that meet as torchrun's would."""
    port = _free_port()
    commands = []
    for rank in range(n):
        env = dict(_env(), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(n),
                   LOCAL_RANK=str(rank))
        commands.append(([sys.executable, "-m", f"tcoll.bench.{backend}_worker"], env))
    return _launch(backend, commands, plan, timeout)


def run_deepspeed(n: int, plan: dict[str, Any], timeout: float) -> dict[str, Any]:
    """Sweep the plan with DeepSpeed's CPU shared-memory all_reduce on n subprocesses."""
    from .deepspeed_worker import shm_segment

    port = _free_port()
    # The op's copies and sums are OpenMP loops: with OpenMP's default (a thread per core in every rank) the
    # ranks' threads outnumber the cores and each call waits for descheduled spinners (ms, not us). DeepSpeed's
    # own launcher (--bind_cores_to_rank) gives each rank cores // ranks threads; so does this, unless set.
    threads = os.environ.get("OMP_NUM_THREADS") or str(max(1, _cores() // n))
    commands = []
    for rank in range(n):
        # LOCAL_SIZE = n: otherwise DeepSpeed never maps its shared memory and every call silently does nothing
        env = dict(_env(), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(n),
                   LOCAL_RANK=str(rank), LOCAL_SIZE=str(n), DS_ACCELERATOR="cpu", OMP_NUM_THREADS=threads)
        commands.append(([sys.executable, "-m", "tcoll.bench.deepspeed_worker"], env))
    try:
        return _launch("deepspeed", commands, plan, timeout)
    finally:
        for rank in range(n):  # the ranks unlink their own segments; these are what a failed run left behind
            env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
            with contextlib.suppress(OSError):
                os.unlink(shm_segment(rank, env))


def run_mpi(n: int, plan: dict[str, Any], timeout: float) -> dict[str, Any]:
    """Sweep the plan with mpi4py on `mpiexec -n N` processes."""
    launcher = plan.get("mpiexec") or mpiexec()
    if launcher is None:
        raise BenchError("mpi: no mpiexec found")
    command = [launcher, "-n", str(n), sys.executable, "-m", "tcoll.bench.mpi_worker"]
    return _launch("mpi", [(command, _env())], plan, timeout)


def run_tcoll_mpi(n: int, plan: dict[str, Any], timeout: float) -> dict[str, Any]:
    """Sweep the plan with tcoll's collectives over its MPI engine on `mpiexec -n N` processes."""
    launcher = plan.get("mpiexec") or mpiexec()
    if launcher is None:
        raise BenchError("tcoll-mpi: no mpiexec found")
    env = {k: v for k, v in _env().items() if k not in ("TCOLL_MASTER", "MASTER_ADDR", "TCOLL_RANK", "TCOLL_SIZE")}
    env["TCOLL_TRANSPORT"] = "mpi"
    command = [launcher, "-n", str(n), sys.executable, "-m", "tcoll.bench.tcoll_mpi_worker"]
    return _launch("tcoll-mpi", [(command, env)], plan, timeout)
