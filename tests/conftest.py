"""Fixtures every test may use; helpers shared by tests live in tests/helpers.

The test folders mirror the packages of src/tcoll. This file's folder is on
sys.path (pytest puts it there), so tests import `helpers.procs` and friends.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from helpers.procs import descendants, kill_all, leftover_processes


@pytest.fixture(name="no_leftovers")
def no_leftovers_fixture() -> Iterator[None]:
    """Fail a test that leaves processes (ranks) or threads (rank threads, store servers) behind.

    The one leak check of the tests: threads get 10 s to end (a server's
    connection handlers finish after it closes).
    """
    processes_before = descendants()
    threads_before = set(threading.enumerate())
    yield
    problems = []
    extra = leftover_processes(processes_before)
    if extra:
        kill_all(extra)
        problems.append(f"processes left running: {extra}")
    children = multiprocessing.active_children()
    if children:
        problems.append(f"multiprocessing.active_children() = {children}")
    deadline = time.monotonic() + 10
    while threads := [t for t in threading.enumerate() if t not in threads_before and t.is_alive()]:
        if time.monotonic() > deadline:
            problems.append(f"threads left running: {threads}")
            break
        threads[0].join(0.05)
    if problems:
        pytest.fail("; ".join(problems))


@pytest.fixture(name="popen")
def popen_fixture() -> Iterator[Any]:
    """Start subprocesses (each in its own session) that are killed and reaped at teardown, pass or fail."""
    import subprocess

    started: list[subprocess.Popen[Any]] = []

    def start(args: list[str], **kwargs: Any) -> subprocess.Popen[Any]:
        proc = subprocess.Popen(args, start_new_session=True, **kwargs)
        started.append(proc)
        return proc

    yield start
    for proc in started:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # the group: also what the process started itself
        except OSError:
            pass
        if proc.returncode is not None:
            continue  # the test reaped it
        try:
            proc.communicate(timeout=10)
        except Exception:  # noqa: BLE001 - reap at any cost
            proc.kill()
            proc.wait()
