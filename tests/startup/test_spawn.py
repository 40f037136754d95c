"""Tests of `tcoll.spawn`: results, arguments, failures, timeouts, pickling, env and init keywords."""

from __future__ import annotations

import os
import re
import signal
import sys
import threading
import time
from typing import Any

import numpy as np
import pytest
from helpers.procs import spawn_as

import tcoll
from tcoll import SpawnError

pytestmark = [pytest.mark.usefixtures("no_leftovers"), pytest.mark.timeout(60)]

# How the ranks run: processes (auto, shm, tcp) or threads of this process.
MODES = ["processes", "shm", "tcp", "threads"]


# -- what the ranks do -----------------------------------------------------------------------


def _finish_in_reverse(comm: tcoll.Communicator, word: str, number: int) -> tuple[int, int, str, int]:
    """Rank size-1 returns first, rank 0 last."""
    if comm.rank + 1 < comm.size:
        comm.recv(np.zeros(1), comm.rank + 1)
    if comm.rank > 0:
        comm.send(np.zeros(1), comm.rank - 1)
    return comm.rank, comm.size, word, number


def _value_error_on_rank_1(comm: tcoll.Communicator) -> None:
    if comm.rank == 1:
        raise ValueError("bad value 42")
    # Blocked on the failing rank: the PeerLostError this rank gets is an echo, not the cause.
    comm.recv(np.zeros(1), 1)


def _exit_on_rank_1(comm: tcoll.Communicator, how: str) -> int:
    if comm.rank == 1:
        if how == "sys.exit":
            sys.exit(3)
        os._exit(3)
    return comm.rank


def _hang(comm: tcoll.Communicator, ignore_sigterm: bool) -> None:
    if ignore_sigterm:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    threading.Event().wait()  # never set: only spawn can end this rank


def _block_in_recv(comm: tcoll.Communicator) -> None:
    comm.recv(np.zeros(1), (comm.rank + 1) % comm.size, tag=1, timeout=60)


def _read_env(comm: tcoll.Communicator, name: str) -> tuple[str | None, float]:
    return os.environ.get(name), comm.timeout


def _what_init_got(comm: tcoll.Communicator) -> dict[str, Any]:
    return {"transports": sorted({comm.transport(p) for p in range(comm.size) if p != comm.rank}),
            "timeout": comm.timeout, "size": comm.size}


def _return_unpicklable(comm: tcoll.Communicator) -> Any:
    return threading.Lock() if comm.rank == 1 else None


class _TwoArgError(Exception):
    """Pickles, but does not unpickle: Exception.__reduce__ passes only the message back."""

    def __init__(self, a: int, b: int) -> None:
        super().__init__(f"two args {a} and {b}")


def _raise_two_arg_error(comm: tcoll.Communicator) -> None:
    if comm.rank == 0:
        raise _TwoArgError(1, 2)


# -- results and arguments -------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
def test_results_in_rank_order_with_args(mode: str) -> None:
    assert spawn_as(mode, _finish_in_reverse, 4, "word", 7) == [(r, 4, "word", 7) for r in range(4)]


def test_one_rank() -> None:
    assert tcoll.spawn(_finish_in_reverse, 1, ("one", 1), timeout=30) == [(0, 1, "one", 1)]


@pytest.mark.parametrize("nprocs", [0, -1, 1.5, "2", None, True])
def test_bad_nprocs(nprocs: Any) -> None:
    with pytest.raises(ValueError, match="nprocs"):
        tcoll.spawn(_finish_in_reverse, nprocs, ("x", 0))


# -- failures --------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["shm", "tcp", "threads"])
def test_rank_raising_is_named_with_its_exception_and_traceback(mode: str) -> None:
    # tcp tells the blocked ranks at once, so their PeerLostError races the real failure to the parent.
    for _ in range(5 if mode == "tcp" else 1):
        with pytest.raises(SpawnError) as info:
            spawn_as(mode, _value_error_on_rank_1, 3)
        error = info.value
        assert error.rank == 1, error
        assert isinstance(error.__cause__, ValueError) and str(error.__cause__) == "bad value 42"
        assert "rank 1" in str(error) and "ValueError: bad value 42" in str(error)
        assert "_value_error_on_rank_1" in error.remote_traceback
        assert "ValueError: bad value 42" in error.remote_traceback
        assert isinstance(error, tcoll.TcollError)


@pytest.mark.parametrize("mode", ["processes", "threads"])
def test_sys_exit_names_the_exit_code(mode: str) -> None:
    with pytest.raises(SpawnError) as info:
        spawn_as(mode, _exit_on_rank_1, 2, "sys.exit")
    assert info.value.rank == 1
    assert re.search(r"\bexit(ed with)? code 3\b", str(info.value)), str(info.value)


def test_os_exit_names_the_exit_code() -> None:
    with pytest.raises(SpawnError) as info:
        tcoll.spawn(_exit_on_rank_1, 2, ("os._exit",), timeout=30)
    assert info.value.rank == 1
    assert re.search(r"\bexit(ed with)? code 3\b", str(info.value)), str(info.value)


def test_result_that_does_not_pickle() -> None:
    with pytest.raises(SpawnError) as info:
        tcoll.spawn(_return_unpicklable, 2, timeout=30)
    assert info.value.rank == 1
    assert "could not send the result back" in str(info.value) + info.value.remote_traceback


def test_exception_that_does_not_unpickle_still_reports_the_rank_and_traceback() -> None:
    with pytest.raises(SpawnError) as info:
        tcoll.spawn(_raise_two_arg_error, 2, timeout=30)
    assert info.value.rank == 0
    assert "two args 1 and 2" in str(info.value)
    assert "_raise_two_arg_error" in info.value.remote_traceback


# -- timeouts --------------------------------------------------------------------------------


@pytest.mark.parametrize("ignore_sigterm", [False, True], ids=["plain", "ignores-sigterm"])
def test_timeout_stops_every_rank_process(ignore_sigterm: bool) -> None:
    start = time.monotonic()
    with pytest.raises(tcoll.TimeoutError) as info:
        tcoll.spawn(_hang, 2, (ignore_sigterm,), timeout=1)
    elapsed = time.monotonic() - start
    assert 1 <= elapsed < 10
    assert info.value.peers == [0, 1]
    assert "within 1 s" in str(info.value)
    # no_leftovers checks that no rank process survives.


def test_timeout_stops_every_rank_thread() -> None:
    start = time.monotonic()
    with pytest.raises(tcoll.TimeoutError) as info:
        tcoll.spawn(_block_in_recv, 3, threads=True, timeout=1)
    assert time.monotonic() - start < 1 + 5, "each rank thread got the whole timeout, one after another"
    assert info.value.peers == [0, 1, 2]
    alive = [t.name for t in threading.enumerate() if t.name.startswith("tcoll-rank-")]
    assert not alive, f"rank threads still running after the timeout: {alive}"


# -- pickling the function -------------------------------------------------------------------


def test_lambda_and_closure_with_cloudpickle() -> None:
    pytest.importorskip("cloudpickle")
    offset = 5
    assert tcoll.spawn(lambda comm: comm.rank * 2, 2, timeout=30) == [0, 2]
    assert tcoll.spawn(lambda comm, k: comm.rank + offset + k, 3, (10,), timeout=30) == [15, 16, 17]


def test_lambda_without_cloudpickle_is_a_clear_type_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "cloudpickle", None)  # import cloudpickle -> ImportError
    with pytest.raises(TypeError, match="picklable") as info:
        tcoll.spawn(lambda comm: comm.rank, 2, timeout=30)
    assert "cloudpickle" in str(info.value) and "module level" in str(info.value)
    # no_leftovers checks that nothing (store server, ranks) was started.


def test_threads_need_no_pickling() -> None:
    lock = threading.Lock()  # unpicklable, shared by reference
    assert tcoll.spawn(lambda comm, held: (comm.rank, held is lock), 2, (lock,), threads=True, timeout=30) == [
        (0, True), (1, True)]


# -- env= and init keywords ------------------------------------------------------------------


def test_env_reaches_the_ranks_and_init() -> None:
    name = "TCOLL_SPAWN_TEST_VALUE"
    got = tcoll.spawn(_read_env, 2, (name,), env={name: "hello", "TCOLL_TIMEOUT": "7"})
    assert got == [("hello", 7.0)] * 2  # TCOLL_TIMEOUT reached tcoll.init in the rank
    assert name not in os.environ


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_init_keywords_reach_init(transport: str) -> None:
    got = tcoll.spawn(_what_init_got, 3, transport=transport, timeout=25)
    assert got == [{"transports": [transport], "timeout": 25.0, "size": 3}] * 3


def test_init_keywords_reach_init_of_thread_ranks() -> None:
    got = tcoll.spawn(_what_init_got, 2, threads=True, transport="tcp", timeout=25)
    assert got == [{"transports": ["tcp"], "timeout": 25.0, "size": 2}] * 2


@pytest.mark.parametrize("threads", [False, True])
def test_bad_init_keywords_are_refused_before_any_rank_starts(threads: bool) -> None:
    with pytest.raises(ValueError, match="carrier-pigeon"):
        tcoll.spawn(_what_init_got, 2, threads=threads, transport="carrier-pigeon", timeout=30)
    with pytest.raises(TypeError, match="transprot"):
        tcoll.spawn(_what_init_got, 2, threads=threads, transprot="tcp", timeout=30)
    with pytest.raises(TypeError, match="run_id"):
        tcoll.spawn(_what_init_got, 2, threads=threads, run_id="mine", timeout=30)
    # no_leftovers checks that nothing was started.
