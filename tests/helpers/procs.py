"""Helpers for tests that run ranks: processes and threads, leftovers, shm segments, file signals, environments.

Ranks in different processes synchronise through files (written atomically,
polled with a deadline) or through tcoll messages, never through sleeps.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import socket
import threading
import time
from pathlib import Path
from collections.abc import Callable
from types import ModuleType
from typing import Any


SHM_DIR = "/dev/shm"

# Long-lived helpers of the test process, started by multiprocessing: they are
# not leftovers of a test (the processes they fork are, though).
_HELPERS = (b"multiprocessing.forkserver", b"multiprocessing.resource_tracker")


# -- files as signals between ranks ---------------------------------------------------------


def load_script(path: str | os.PathLike[str], name: str) -> ModuleType:
    """Import the Python file `path` (a script or example, not on sys.path) as the module `name`."""
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def write_json(path: str | os.PathLike[str], obj: Any) -> None:
    """Write `obj` as JSON to `path` atomically (a reader sees all of it or nothing)."""
    tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
    with open(tmp, "w") as handle:
        json.dump(obj, handle)
    os.rename(tmp, path)


def read_json(path: str | os.PathLike[str]) -> Any:
    with open(path) as handle:
        return json.load(handle)


def touch(path: str | os.PathLike[str]) -> None:
    """Create `path` (a signal another rank polls for)."""
    write_json(path, True)


def wait_file(path: str | os.PathLike[str], timeout: float = 20.0) -> None:
    """Poll until `path` exists; AssertionError after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        assert time.monotonic() < deadline, f"{path} did not appear within {timeout} s"
        time.sleep(0.005)


# -- shared memory --------------------------------------------------------------------------


def shm_segments(run_id: str) -> list[str]:
    """The /dev/shm entries of the tcoll run `run_id` (tcoll-<run id>-...)."""
    return sorted(name for name in os.listdir(SHM_DIR) if name.startswith(f"tcoll-{run_id}-"))


# -- processes ------------------------------------------------------------------------------


def _stat(pid: str) -> tuple[int, str] | None:
    """(ppid, state) of a process, or None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as handle:
            fields = handle.read().rpartition(b")")[2].split()
    except OSError:
        return None
    return int(fields[1]), fields[0].decode()


def _is_helper(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as handle:
            cmdline = handle.read()
    except OSError:
        return False
    return any(helper in cmdline for helper in _HELPERS)


def descendants() -> dict[int, str]:
    """Every process below this one ({pid: state}), except the multiprocessing helpers themselves.

    Rank processes started with the forkserver method are children of the
    forkserver, so the whole tree is walked, not only direct children. A
    zombie (state "Z") counts: it is a child nobody reaped.
    """
    parents: dict[int, tuple[int, str]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            info = _stat(entry)
            if info is not None:
                parents[int(entry)] = info
    me = os.getpid()
    found: dict[int, str] = {}
    frontier = [me]
    while frontier:
        parent = frontier.pop()
        for pid, (ppid, state) in parents.items():
            if ppid == parent and pid not in found:
                found[pid] = state
                frontier.append(pid)
    return {pid: state for pid, state in found.items() if not _is_helper(pid)}


def leftover_processes(before: dict[int, str], timeout: float = 10.0) -> dict[int, str]:
    """Processes below this one that were not there before, once `timeout` has let them go."""
    deadline = time.monotonic() + timeout
    while True:
        extra = {pid: state for pid, state in descendants().items() if pid not in before}
        if not extra or time.monotonic() > deadline:
            return extra
        time.sleep(0.02)


def kill_all(pids: dict[int, str]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


def rank_report(directory: str | os.PathLike[str], rank: int) -> dict[str, Any]:
    """The report a rank wrote with `write_report` (fails the test if it did not)."""
    path = Path(directory) / f"report{rank}.json"
    assert path.exists(), f"rank {rank} wrote no report (it was stopped or hung)"
    return read_json(path)


def write_report(directory: str | os.PathLike[str], rank: int, report: dict[str, Any]) -> None:
    write_json(Path(directory) / f"report{rank}.json", report)


# -- plain subprocesses -----------------------------------------------------------------------

ROOT = Path(__file__).resolve().parents[2]  # the checkout
SRC = str(ROOT / "src")

# Variables through which a launcher tells a process its rank: none may leak into a test's ranks.
_LAUNCHER_PREFIXES = ("TCOLL_", "TORCHELASTIC_", "OMPI_", "PMI_", "PMIX_", "MPI_LOCAL", "SLURM_")
_LAUNCHER_NAMES = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT"}


def clean_env(**extra: str) -> dict[str, str]:
    """This environment without any launcher variable, with tcoll importable, plus `extra`."""
    env = {k: v for k, v in os.environ.items()
           if k not in _LAUNCHER_NAMES and not k.startswith(_LAUNCHER_PREFIXES)}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (SRC, env.get("PYTHONPATH", "")) if p)
    env.update(extra)
    return env


def run_ranks(cwd: str | os.PathLike[str], args: list[str], size: int, run_id: str, timeout: float = 45,
              **extra: str) -> list[int]:
    """Run `python <args>` as ranks 0..size-1 of one job whose store this process hosts (key "k").

    Each rank gets the variables `tcoll run` would give it, plus `extra`. Ranks still
    running after `timeout` seconds are killed (and the test fails on their exit code).

    Returns:
        Each rank's exit code.
    """
    import subprocess
    import sys

    from tcoll.store.tcp import TCPStoreServer

    server = TCPStoreServer("127.0.0.1", 0, auth_key="k")
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for rank in range(size):
            env = clean_env(TCOLL_RANK=str(rank), TCOLL_SIZE=str(size), TCOLL_LOCAL_RANK=str(rank),
                            TCOLL_LOCAL_SIZE=str(size), TCOLL_MASTER=f"127.0.0.1:{server.port}",
                            TCOLL_STORE_HOSTED="1", TCOLL_RUN_ID=run_id, TCOLL_AUTH_KEY="k", **extra)
            procs.append(subprocess.Popen([sys.executable, *args], cwd=cwd, env=env))
        deadline = time.monotonic() + timeout
        for proc in procs:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
        return [proc.wait() for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        server.close()


# -- ranks on threads or through tcoll.spawn ----------------------------------------------------


def spawn_as(mode: str, fn: Any, nprocs: int, *args: Any, **settings: Any) -> list[Any]:
    """tcoll.spawn(fn, nprocs, args) with its ranks run as `mode` says; the ranks' results.

    Args:
        mode: "threads" (or "loopback", their transport): threads of this process;
            "processes": processes, with the transport tcoll chooses; a transport
            ("shm", "tcp"): processes that use it.
        settings: tcoll.spawn's keywords and Settings fields (timeout: 30 s unless given).
    """
    import tcoll

    settings.setdefault("timeout", 30)
    if mode in ("threads", "loopback"):
        return tcoll.spawn(fn, nprocs, args, threads=True, **settings)
    if mode != "processes":
        settings["transport"] = mode
    return tcoll.spawn(fn, nprocs, args, **settings)


def on_threads(n: int, fn: Callable[[int], Any], join_timeout: float = 50.0) -> list[Any]:
    """Run fn(rank) for ranks 0..n-1, each on a thread of its own; re-raise the first failure; the results.

    For tests of the layers below a communicator (stores, rendezvous, transports),
    whose ranks are plain functions; fails the test if a rank is still running after
    `join_timeout` seconds.
    """
    results: list[Any] = [None] * n
    errors: list[BaseException | None] = [None] * n

    def body(rank: int) -> None:
        try:
            results[rank] = fn(rank)
        except BaseException as exc:  # noqa: BLE001 - handed to the test thread
            errors[rank] = exc

    threads = [threading.Thread(target=body, args=(r,), name=f"rank-{r}") for r in range(n)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(join_timeout)
        assert not thread.is_alive(), "a rank hung"
    for error in errors:
        if error is not None:
            raise error
    return results


# -- ports ------------------------------------------------------------------------------------


def free_port(span: int = 1) -> int:
    """A TCP port on 127.0.0.1 that nothing listens on (at the time of asking).

    Args:
        span: how many consecutive ports from it must be free (2 for a launcher
            whose rendezvous takes MASTER_PORT = port + 1).
    """
    while True:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = int(sock.getsockname()[1])
            if all(_bindable(port + k) for k in range(1, span)):
                return port


def _bindable(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def hung_up(sock: socket.socket, within: float) -> bool:
    """Whether the other end closed `sock` within `within` seconds (reading and dropping what it sent first;
    this side never closes it first)."""
    sock.settimeout(within)
    try:
        while sock.recv(65536):
            pass
    except TimeoutError:
        return False
    except ConnectionResetError:
        pass
    return True
