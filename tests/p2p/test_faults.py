"""Behaviour under faults (DESIGN section 4): lost peers, timeouts, Work handles, cleanup.

Process ranks run on shm and tcp, thread ranks on loopback. A thread cannot be
killed, so on loopback "the peer dies" means its rank function ends and its
communicator closes. A killed rank's survivors ignore SIGTERM: `tcoll.spawn`
stops the other ranks as soon as it sees one die, and the survivors must live
long enough to write down what they saw.
"""

from __future__ import annotations

import builtins
import mmap
import os
import secrets
import signal
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from helpers.procs import (clean_env, free_port, rank_report, read_json, shm_segments, spawn_as, touch, wait_file,
                           write_report)

import tcoll
from tcoll import PeerLostError, SpawnError
from tcoll.p2p.engine import Engine
from tcoll.env import Settings
from tcoll.p2p.channel import Channel
from tcoll.p2p.waiting import Doorbell

pytestmark = pytest.mark.usefixtures("no_leftovers")

PROCESS_TRANSPORTS = ["shm", "tcp"]
ALL_TRANSPORTS = ["loopback", "shm", "tcp"]


def _more_than_socket_buffers() -> int:
    """A message size no shm ring (4 MiB at most) and no pair of TCP socket buffers can hold whole."""
    limit = 0
    for table in ("/proc/sys/net/ipv4/tcp_rmem", "/proc/sys/net/ipv4/tcp_wmem"):
        try:
            with open(table) as handle:
                limit += int(handle.read().split()[2])
        except (OSError, ValueError, IndexError):
            limit += 32 << 20
    return max(64 << 20, 2 * limit)


BIG = _more_than_socket_buffers()
SPAWN_TIMEOUT = 30.0
_run_ids: list[str] = []  # every process run of this module, for the final /dev/shm check


# -- what the ranks do -----------------------------------------------------------------------


def _die(how: str) -> None:
    """End this rank abruptly: SIGKILL (processes), or leave with an error (threads)."""
    if how == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    raise RuntimeError("rank 0 leaves the job")


def _keep_alive_for_report(how: str) -> None:
    if how == "kill":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)


def _later_ops(comm: tcoll.Communicator, peer: int) -> dict[str, Any]:
    """Try each kind of new operation on a lost peer; each must raise PeerLostError at once."""
    ops = {
        "isend": lambda: comm.isend(np.ones(1), peer),
        "irecv": lambda: comm.irecv(np.zeros(1), peer),
        "send": lambda: comm.send(np.ones(1), peer, timeout=5),
        "recv": lambda: comm.recv(np.zeros(1), peer, timeout=5),
    }
    outcome: dict[str, Any] = {}
    for name, op in ops.items():
        start = time.monotonic()
        try:
            op()
            outcome[name] = "no error"
        except tcoll.PeerLostError as exc:
            outcome[name] = {"rank": exc.rank, "elapsed": time.monotonic() - start}
        except Exception as exc:  # noqa: BLE001 - reported to the test
            outcome[name] = repr(exc)
    return outcome


def _wait_for_loss(comm: tcoll.Communicator, work: tcoll.Work, peer: int) -> dict[str, Any]:
    """Wait on `work`, which needs the lost `peer`; describe how it failed."""
    start = time.monotonic()
    try:
        work.wait()
    except Exception as exc:  # noqa: BLE001 - reported to the test
        return {
            "type": type(exc).__name__,
            "connection_error": isinstance(exc, ConnectionError),
            "rank": getattr(exc, "rank", None),
            "message": str(exc),
            "elapsed": time.monotonic() - start,
            "done": work.done(),
            # (wait() raises a copy of the kept error: the kept one must not hold the caller's frames)
            "exception_is_it": type(work.exception()) is type(exc) and str(work.exception()) == str(exc),
            "later": _later_ops(comm, peer),
            "run_id": comm.run_id,
        }
    return {"type": None, "run_id": comm.run_id}


def _peer_dies_while_others_block_in_recv(comm: tcoll.Communicator, report_dir: str, how: str) -> None:
    victim = 0
    if comm.rank == victim:
        for peer in range(1, comm.size):
            comm.recv(np.zeros(1), peer, tag=1)  # every survivor has posted its receive
        _die(how)
    _keep_alive_for_report(how)
    work = comm.irecv(np.zeros(4), victim, tag=2)
    comm.send(np.ones(1), victim, tag=1)
    report = _wait_for_loss(comm, work, victim)
    # The survivors (ranks 1 and 2) still talk to each other.
    other = 3 - comm.rank
    got = np.zeros(1, dtype=np.int64)
    try:
        incoming = comm.irecv(got, other, tag=3)
        comm.send(np.array([comm.rank], dtype=np.int64), other, tag=3, timeout=10)
        incoming.wait(timeout=10)
        report["survivor_got"] = int(got[0])
    except Exception as exc:  # noqa: BLE001 - reported to the test
        report["survivor_got"] = repr(exc)
    write_report(report_dir, comm.rank, report)


def _receiver_dies_while_sender_blocked(comm: tcoll.Communicator, report_dir: str, how: str) -> None:
    victim, posted = 0, os.path.join(report_dir, "posted")
    if comm.rank == victim:
        wait_file(posted)  # never posts the receive; goes once the sender is stuck
        _die(how)
    _keep_alive_for_report(how)
    work = comm.isend(np.ones(BIG, dtype=np.uint8), victim, tag=5)
    blocked = not work.done()
    touch(posted)
    report = _wait_for_loss(comm, work, victim)
    report["blocked"] = blocked
    write_report(report_dir, comm.rank, report)


def _describe_timeout(exc: BaseException, start: float) -> dict[str, Any]:
    return {
        "type": type(exc).__name__,
        "tcoll": isinstance(exc, tcoll.TimeoutError),
        "builtin": isinstance(exc, builtins.TimeoutError),
        "tcoll_error": isinstance(exc, tcoll.TcollError),
        "peers": getattr(exc, "peers", None),
        "message": str(exc),
        "elapsed": time.monotonic() - start,
    }


def _silent_peer(comm: tcoll.Communicator) -> dict[str, Any] | None:
    if comm.rank == 1:
        comm.recv(np.zeros(1), 0, tag=9)  # alive, and silent until rank 0 has timed out
        comm.send(np.full(2, 7.0), 0, tag=5)
        return None
    report: dict[str, Any] = {}
    start = time.monotonic()
    try:
        comm.recv(np.zeros(2), 1, tag=6, timeout=0.5)
        report["recv"] = "no error"
    except Exception as exc:  # noqa: BLE001 - reported to the test
        report["recv"] = _describe_timeout(exc, start)
    box = np.zeros(2)
    work = comm.irecv(box, 1, tag=5)
    start = time.monotonic()
    try:
        work.wait(timeout=0.3)
        report["wait"] = "no error"
    except Exception as exc:  # noqa: BLE001 - reported to the test
        report["wait"] = _describe_timeout(exc, start)
    report["after_timeout"] = {"done": work.done(), "exception": repr(work.exception())}
    comm.send(np.zeros(1), 1, tag=9)
    report["result_is_box"] = work.wait(timeout=20) is box
    report["box"] = box.tolist()
    report["after_wait"] = {"done": work.done(), "exception": repr(work.exception())}
    return report


def _work_handles(comm: tcoll.Communicator, report_dir: str) -> dict[str, Any]:
    """Rank 0 receives, rank 1 sends; each records what its Work handles say at each step."""
    timed_out = os.path.join(report_dir, "send-timed-out")
    report: dict[str, Any] = {}
    if comm.rank == 0:
        box = np.zeros(3)
        work = comm.irecv(box, 1, tag=1)
        report["before"] = {"done": work.done(), "exception": repr(work.exception())}
        comm.send(np.zeros(1), 1, tag=2)  # now rank 1 may send
        deadline = time.monotonic() + 20
        while not work.done():  # done() makes progress itself
            assert time.monotonic() < deadline, "the receive never completed"
        report["after"] = {"done": work.done(), "exception": repr(work.exception()),
                           "result_is_box": work.result() is box, "wait_is_box": work.wait(timeout=1) is box,
                           "box": box.tolist()}
        wait_file(timed_out)  # rank 1's large send has timed out once: receive it now
        big = np.zeros(BIG, dtype=np.uint8)
        comm.recv(big, 1, tag=3, timeout=20)
        report["big_ok"] = bool(big[0] == 1 and big[-1] == 1)
        return report
    comm.recv(np.zeros(1), 0, tag=2)
    payload = np.array([1.0, 2.0, 3.0])
    work = comm.isend(payload, 0, tag=1)
    report["send_wait_is_payload"] = work.wait(timeout=20) is payload
    report["send_after"] = {"done": work.done(), "exception": repr(work.exception())}
    big = np.ones(BIG, dtype=np.uint8)
    work = comm.isend(big, 0, tag=3)  # rank 0 does not receive it before the file says so
    start = time.monotonic()
    try:
        work.wait(timeout=0.3)
        report["big_timeout"] = "no error"
    except Exception as exc:  # noqa: BLE001 - reported to the test
        report["big_timeout"] = _describe_timeout(exc, start)
    report["big_pending"] = {"done": work.done(), "exception": repr(work.exception())}
    touch(timed_out)
    work.wait(timeout=20)
    report["big_after"] = {"done": work.done(), "exception": repr(work.exception())}
    return report


# -- a lost peer -----------------------------------------------------------------------------

# (transport, how the victim goes)
LOSSES = [("shm", "kill"), ("tcp", "kill"), ("loopback", "raise")]


def _check_loss_report(report: dict[str, Any], victim: int) -> None:
    assert report["type"] == "PeerLostError", report
    assert report["connection_error"]
    assert report["rank"] == victim and f"rank {victim}" in report["message"]
    assert report["elapsed"] < 10, f"the loss took {report['elapsed']:.1f} s to notice"
    assert report["done"] and report["exception_is_it"], "the failed Work must say done() and hold the error"
    for name, outcome in report["later"].items():
        assert isinstance(outcome, dict), f"{name} to the lost rank: {outcome}"
        assert outcome["rank"] == victim
        assert outcome["elapsed"] < 0.5, f"{name} to the lost rank took {outcome['elapsed']:.2f} s to fail"


def _check_spawn_error(error: SpawnError, how: str) -> None:
    assert error.rank == 0, error
    if how == "kill":
        assert "SIGKILL" in str(error)
    else:
        assert isinstance(error.__cause__, RuntimeError)


@pytest.mark.alone  # (later calls to the lost rank must fail within 0.5 s)
@pytest.mark.timeout(60)
@pytest.mark.parametrize("transport,how", LOSSES)
def test_peer_lost_while_others_block_in_recv(transport: str, how: str, tmp_path: Path) -> None:
    with pytest.raises(SpawnError) as info:
        spawn_as(transport, _peer_dies_while_others_block_in_recv, 3, str(tmp_path), how)
    _check_spawn_error(info.value, how)
    for rank in (1, 2):
        report = rank_report(tmp_path, rank)
        _run_ids.append(report["run_id"])
        _check_loss_report(report, victim=0)
        assert report["survivor_got"] == 3 - rank, "the survivors could not talk to each other"
        assert shm_segments(report["run_id"]) == []


@pytest.mark.alone  # (later calls to the lost rank must fail within 0.5 s)
@pytest.mark.timeout(60)
@pytest.mark.parametrize("transport,how", LOSSES)
def test_peer_lost_while_sender_blocked(transport: str, how: str, tmp_path: Path) -> None:
    with pytest.raises(SpawnError) as info:
        spawn_as(transport, _receiver_dies_while_sender_blocked, 2, str(tmp_path), how)
    _check_spawn_error(info.value, how)
    report = rank_report(tmp_path, 1)
    _run_ids.append(report["run_id"])
    assert report["blocked"], f"a {BIG} B send completed without a receiver"
    _check_loss_report(report, victim=0)
    assert shm_segments(report["run_id"]) == []


# -- timeouts and Work handles ---------------------------------------------------------------


@pytest.mark.timeout(60)
@pytest.mark.parametrize("transport", ALL_TRANSPORTS)
def test_silent_peer_times_out(transport: str) -> None:
    report = spawn_as(transport, _silent_peer, 2)[0]
    recv = report["recv"]
    assert isinstance(recv, dict), recv
    assert recv["tcoll"] and recv["builtin"] and recv["tcoll_error"], recv
    assert recv["peers"] == [1]
    assert "recv from rank 1" in recv["message"] and "tag 6" in recv["message"], recv["message"]
    assert "0.5" in recv["message"]
    assert 0.5 <= recv["elapsed"] < 5
    wait = report["wait"]
    assert isinstance(wait, dict) and wait["tcoll"] and wait["peers"] == [1], wait
    assert 0.3 <= wait["elapsed"] < 5
    # A timeout does not cancel a Work: it stays pending, and completes once the peer sends.
    assert report["after_timeout"] == {"done": False, "exception": "None"}
    assert report["result_is_box"] and report["box"] == [7.0, 7.0]
    assert report["after_wait"] == {"done": True, "exception": "None"}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("transport", ALL_TRANSPORTS)
def test_work_wait_done_exception(transport: str, tmp_path: Path) -> None:
    receiver, sender = spawn_as(transport, _work_handles, 2, str(tmp_path))
    assert receiver["before"] == {"done": False, "exception": "None"}
    assert receiver["after"] == {"done": True, "exception": "None", "result_is_box": True, "wait_is_box": True,
                                 "box": [1.0, 2.0, 3.0]}
    assert receiver["big_ok"]
    assert sender["send_wait_is_payload"]
    assert sender["send_after"] == {"done": True, "exception": "None"}
    timeout = sender["big_timeout"]
    assert isinstance(timeout, dict) and timeout["tcoll"] and timeout["peers"] == [0], timeout
    assert "send to rank 0" in timeout["message"]
    assert sender["big_pending"] == {"done": False, "exception": "None"}
    assert sender["big_after"] == {"done": True, "exception": "None"}


def _retry_after_timeout(comm: tcoll.Communicator) -> float | None:
    if comm.rank == 1:
        comm.recv(np.zeros(1), 0, tag=9)
        comm.send(np.array([42.0]), 0, tag=6)
        return None
    try:
        comm.recv(np.zeros(1), 1, tag=6, timeout=0.2)
    except tcoll.TimeoutError:
        pass
    comm.send(np.zeros(1), 1, tag=9)
    retry = np.zeros(1)
    comm.recv(retry, 1, tag=6, timeout=2)  # the one message sent on tag 6 must land here
    return float(retry[0])


@pytest.mark.timeout(60)
def test_retry_after_recv_timeout_gets_the_message() -> None:
    assert tcoll.spawn(_retry_after_timeout, 2, threads=True, timeout=SPAWN_TIMEOUT)[0] == 42.0


# -- without tcoll.spawn: plain processes that meet through tcp:// -----------------------------

RANK_SCRIPT = """
    import json, os, signal, sys, time
    import numpy as np
    import tcoll

    rank, victim, port, transport, timeout, out = sys.argv[1:]
    rank, victim = int(rank), int(victim)
    comm = tcoll.init(rank=rank, size=2, init_method=f"tcp://127.0.0.1:{port}", timeout=float(timeout),
                      transport=transport)
    other = 1 - rank
    if rank == victim:
        comm.recv(np.zeros(1), other, tag=1)
        os.kill(os.getpid(), signal.SIGKILL)
    work = comm.irecv(np.zeros(1), other, tag=2)
    comm.send(np.zeros(1), other, tag=1)
    start = time.monotonic()
    try:
        work.wait()
        report = {"type": None}
    except Exception as exc:
        report = {"type": type(exc).__name__, "rank": getattr(exc, "rank", None),
                  "elapsed": time.monotonic() - start}
    report["run_id"] = comm.run_id
    start = time.monotonic()
    comm.close()
    report["close"] = time.monotonic() - start
    with open(out + ".tmp", "w") as handle:
        json.dump(report, handle)
    os.rename(out + ".tmp", out)
"""


def _kill_one_of_two(popen: Any, tmp_path: Path, transport: str, victim: int, timeout: float) -> dict[str, Any]:
    """Run RANK_SCRIPT on two plain processes; `victim` kills itself; return the survivor's report."""
    script = tmp_path / "rank.py"
    script.write_text(textwrap.dedent(RANK_SCRIPT))
    run_id = f"faults{secrets.token_hex(4)}"
    port, out = free_port(), tmp_path / "survivor.json"
    procs = [popen([sys.executable, str(script), str(rank), str(victim), str(port), transport, str(timeout), str(out)],
                   env=clean_env(TCOLL_RUN_ID=run_id)) for rank in (0, 1)]
    codes = [proc.wait(timeout=30) for proc in procs]
    assert codes[victim] == -signal.SIGKILL
    assert codes[1 - victim] == 0
    report = read_json(out)
    assert report["run_id"] == run_id
    _run_ids.append(run_id)
    return report


@pytest.mark.timeout(60)
@pytest.mark.parametrize("transport", PROCESS_TRANSPORTS)
def test_kill9_without_spawn_leaves_no_segments(popen: Any, tmp_path: Path, transport: str) -> None:
    # Rank 0 also serves the store: the survivor must get on without it.
    report = _kill_one_of_two(popen, tmp_path, transport, victim=0, timeout=20)
    assert report["type"] == "PeerLostError" and report["rank"] == 0, report
    assert report["elapsed"] < 10
    assert report["close"] < 5
    # No tcoll.spawn here to sweep /dev/shm afterwards: the transport itself must leave nothing.
    assert shm_segments(report["run_id"]) == []


@pytest.mark.timeout(60)
def test_close_after_losing_a_peer_is_prompt(popen: Any, tmp_path: Path) -> None:
    report = _kill_one_of_two(popen, tmp_path, "shm", victim=1, timeout=3)
    assert report["type"] == "PeerLostError" and report["rank"] == 1, report
    assert report["close"] < 1.5, f"close() took {report['close']:.1f} s"


# -- the engine: a message that arrived just before its sender died ---------------------------


class _SentThenDied(Channel):
    """A peer that, while this rank sleeps, sends one 8-byte message and exits."""

    transport_name = "fake"

    def __init__(self, engine: Engine) -> None:
        super().__init__(engine, 1)
        self.gone = False
        self.delivered = False

    def post(self, send: Any) -> None:
        raise AssertionError("nothing is sent in this test")

    def progress(self) -> bool:
        if not self.gone or self.delivered:
            return False
        work = self.engine.match(1, 0, 0, 8)
        work.data[:8] = np.array([42.0]).view(np.uint8)
        work.offset = 8
        self.engine.recv_done(work)
        self.delivered = True
        return True

    def check_alive(self) -> None:
        if self.gone:
            raise PeerLostError(1, "process 12345 on this host is gone")


def test_message_sent_just_before_the_sender_died_is_delivered() -> None:
    channel: _SentThenDied | None = None

    class Bell(Doorbell):
        def sleep(self, seq: int, timeout: float) -> None:
            assert channel is not None
            channel.gone = True  # while we sleep, the peer writes its last message and exits

    engine = Engine(0, 2, Settings(spin_us=0, liveness_interval=1e-9), Bell(mmap.mmap(-1, mmap.PAGESIZE)))
    channel = _SentThenDied(engine)
    engine.add_channel(channel)
    box = np.zeros(1)
    work = engine.irecv(box.view(np.uint8), 1, 0, 0, box)
    try:
        assert work.wait(timeout=5) is box and box[0] == 42.0
    finally:
        engine.close()


# -- declared last: after every run above ------------------------------------------------------


def test_nothing_left_in_dev_shm() -> None:
    if not _run_ids:
        pytest.skip("no run of this module recorded its run id (run the whole module)")
    leftovers = {run_id: shm_segments(run_id) for run_id in _run_ids}
    assert not any(leftovers.values()), leftovers


def test_errors_survive_pickling_with_their_fields() -> None:
    """tcoll.spawn sends a rank's exception to the parent: the copy must say the same thing."""
    import pickle

    for error in (tcoll.PeerLostError(3, "it closed its communicator"), tcoll.TimeoutError("late", [1, 2]),
                  tcoll.RendezvousError("no", [4], "host:1"), tcoll.SpawnError(2, "boom", "trace")):
        copy = pickle.loads(pickle.dumps(error))
        assert type(copy) is type(error) and str(copy) == str(error) and copy.__dict__ == error.__dict__
