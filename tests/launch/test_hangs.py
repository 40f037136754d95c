"""The hang report: induced hangs named by `tcoll run` and by `tcoll status`, and the verdict's rules."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest

from helpers import netns
from tcoll.launch.hangs import Rank, report, verdict
from tcoll.p2p import status

SRC = Path(__file__).resolve().parents[2] / "src"


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TCOLL_")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(SRC), env.get("PYTHONPATH", "")) if p)
    env["TCOLL_STATUS"] = "0.25"  # the ranks sample four times a second: a hang shows, and is reported, sooner
    env.update(extra)
    return env


def _start(tmp_path: Path, body: str, ranks: int, run_id: str, **extra: str) -> subprocess.Popen[str]:
    (tmp_path / "job.py").write_text(textwrap.dedent(body).lstrip())
    return subprocess.Popen([sys.executable, "-m", "tcoll", "run", "-n", str(ranks), "--run-id", run_id, "job.py"],
                            cwd=tmp_path, env=_env(**extra), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _until_verdict(proc: subprocess.Popen[str], containing: str = "") -> str:
    """The launcher's stderr up to the first verdict line that holds `containing` (pytest-timeout bounds it).

    Returns:
        That report: its lines from the header to the verdict.
    """
    lines: list[str] = []
    assert proc.stderr is not None
    for line in proc.stderr:
        if line.startswith("tcoll: hang report"):
            lines = []
        lines.append(line)
        if line.startswith("verdict:") and containing in line:
            return "".join(lines)
    pytest.fail("the launcher ended without a report:\n" + "".join(lines))


def _stop(proc: subprocess.Popen[str]) -> None:
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=30)


def _status(run_id: str) -> str:
    done = subprocess.run([sys.executable, "-m", "tcoll", "status", "--job", run_id], env=_env(),
                          capture_output=True, text=True, timeout=30, check=False)
    assert done.returncode == 0, done.stderr
    return done.stdout


ASLEEP = """
    import os, time, numpy as np, tcoll
    comm = tcoll.init()
    x = np.ones(4)
    for i in range(5):
        if comm.rank == 2 and i == 3:
            open("asleep", "w").close(); time.sleep(300)
        comm.all_reduce(x)
"""


@pytest.mark.timeout(90)
def test_a_rank_asleep_in_user_code_is_named_with_its_line(tmp_path: Path) -> None:
    run_id = f"hangasleep{os.getpid()}"
    proc = _start(tmp_path, ASLEEP, 4, run_id, TCOLL_HANG_REPORT="2", TCOLL_DUMP=str(tmp_path / "dump"))
    try:
        text = _until_verdict(proc, "time.sleep")  # a slow start may be reported first
        stuck_for = time.time() - (tmp_path / "asleep").stat().st_mtime
        assert stuck_for < 15, f"the report came {stuck_for:.0f} s after the hang began"
        verdict_line = text.splitlines()[-1]
        assert "rank 2 has made no call since all_reduce #3" in verdict_line
        assert "job.py:6" in verdict_line and "time.sleep(300)" in verdict_line
        assert "ranks 0, 1 and 3 wait for it in all_reduce #4" in verdict_line
        rows = [line for line in text.splitlines() if line.strip().startswith(("0 ", "1 ", "3 "))]
        assert len(rows) == 3 and all("all_reduce #4" in row and "job.py:7" in row for row in rows), text
        seen = _status(run_id)
        assert verdict_line.split(";")[0] in seen and "all_reduce #4" in seen, seen
        dumps = [tmp_path / "dump" / f"tcoll_trace_{rank}" for rank in range(4)]  # the report asked for them
        deadline = time.monotonic() + 30
        while not all(path.exists() for path in dumps):
            assert time.monotonic() < deadline, "the ranks did not write their flight-recorder dumps"
            time.sleep(0.05)
    finally:
        _stop(proc)
    assert not os.path.exists(status.job_dir(run_id)), "the launcher left the published states behind"
    pytest.importorskip("torch.distributed.flight_recorder.fr_trace")
    analysed = subprocess.run([sys.executable, "-m", "torch.distributed.flight_recorder.fr_trace",
                               str(tmp_path / "dump")], capture_output=True, text=True, timeout=60, check=False)
    assert analysed.returncode == 0, analysed.stderr
    assert "missing ranks: {2}" in analysed.stdout + analysed.stderr
    assert "sequence number: 4" in analysed.stdout + analysed.stderr


DEADLOCK = """
    import numpy as np, tcoll
    comm = tcoll.init()
    x = np.zeros(2)
    comm.recv(x, src=1 - comm.rank, tag=7)
"""


@pytest.mark.timeout(90)
def test_a_receive_deadlock_names_both_ranks_and_their_lines(tmp_path: Path) -> None:
    run_id = f"hangdeadlock{os.getpid()}"
    proc = _start(tmp_path, DEADLOCK, 2, run_id, TCOLL_HANG_REPORT="2")
    try:
        text = _until_verdict(proc, "a deadlock")
        assert "verdict: ranks 0 and 1 each wait to receive from the other (tag 7): a deadlock" in text, text
        rows = [line for line in text.splitlines() if "recv from rank" in line]
        assert len(rows) == 2 and all("job.py:4" in row for row in rows), text
        seen = _status(run_id)
        assert "ranks 0 and 1 each wait to receive from the other (tag 7): a deadlock" in seen, seen
    finally:
        _stop(proc)


WAITS_FOR_GO = """
    import os, time, numpy as np, tcoll
    comm = tcoll.init()
    x = np.ones(4)
    while comm.rank == 1 and not os.path.exists("go"):
        time.sleep(0.05)
    comm.all_reduce(x)
    print("sum", x[0])
"""


def _published(run_id: str, test: Any) -> dict[int, dict[str, Any]]:
    """The job's published states, by rank, once `test` holds for them (pytest-timeout bounds the wait)."""
    directory = status.job_dir(run_id)
    while True:
        states = {s["rank"]: s for s in status.read_job(directory)}
        if test(states):
            return states
        time.sleep(0.05)


@pytest.mark.timeout(90)
def test_sigusr1_reports_and_the_job_goes_on(tmp_path: Path) -> None:
    run_id = f"hangusr1{os.getpid()}"
    proc = _start(tmp_path, WAITS_FOR_GO, 2, run_id, TCOLL_HANG_REPORT="0")
    try:
        # rank 0 waits in its all_reduce; rank 1's line is read a tick after it stopped moving
        _published(run_id, lambda s: len(s) == 2 and s[0].get("waiting") and s[1]["where"] == "job.py:5")
        proc.send_signal(signal.SIGUSR1)
        text = _until_verdict(proc)
        assert "rank 1 has made no call yet, and is at job.py:5" in text, text
        (tmp_path / "go").touch()
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            _stop(proc)
    assert proc.returncode == 0, err
    assert "sum 2.0" in out


ANOTHER_CALL = """
    import numpy as np, tcoll
    comm = tcoll.init()
    pair = comm.split(color=int(comm.rank >= 2))
    x = np.ones(4)
    for i in range(5):
        if comm.rank == 2 and i == 3:
            pair.barrier()
        comm.all_reduce(x)
"""


@pytest.mark.timeout(90)
def test_a_rank_in_another_collective_is_a_deadlock_across_calls(tmp_path: Path) -> None:
    # Rank 2 enters a barrier of the sub-communicator {2, 3} that rank 3 never calls, while ranks 0, 1 and 3 wait
    # for it in the world's all_reduce #5 (the split is #1): no fingerprint can tell, and the timeout is long.
    run_id = f"hangother{os.getpid()}"
    proc = _start(tmp_path, ANOTHER_CALL, 4, run_id, TCOLL_HANG_REPORT="2", TCOLL_TIMEOUT="120")
    try:
        text = _until_verdict(proc, "barrier")  # a slow start may be reported first
        assert ("verdict: a deadlock across calls: rank 2 in barrier #1 among ranks 2 and 3 (job.py:7) waits for "
                "rank 3, which is in all_reduce #5 (job.py:8) and waits for rank 2; ranks 0 and 1 wait for them in "
                "all_reduce #5") in text, text
        row = next(line for line in text.splitlines() if line.strip().startswith("2 "))
        assert "barrier #1 among ranks 2 and 3" in row and "job.py:7 (pair.barrier())" in row, text
        seen = _status(run_id)
        assert "a deadlock across calls: rank 2 in barrier #1 among ranks 2 and 3 (job.py:7)" in seen, seen
    finally:
        _stop(proc)


STOPPED = """
    import time, numpy as np, tcoll
    comm = tcoll.init()
    x = np.ones(4)
    for i in range(5):
        if comm.rank == 2 and i == 3:
            time.sleep(300)
        comm.all_reduce(x)
"""


@pytest.mark.timeout(90)
def test_a_stopped_rank_is_named_as_stopped_with_its_last_line(tmp_path: Path) -> None:
    # Rank 2 is stopped (SIGSTOP, as a debugger does) while it sleeps at line 6: its sampler stops with it, so its
    # published row is the last it wrote; the report tells from /proc that the process is stopped.
    run_id = f"hangstop{os.getpid()}"
    proc = _start(tmp_path, STOPPED, 4, run_id, TCOLL_HANG_REPORT="1.5")
    try:
        states = _published(run_id, lambda s: len(s) == 4 and s[2]["where"] == "job.py:6" and all(
            (s[r].get("waiting") or {}).get("peers") == [2] for r in (0, 1, 3)))
        os.kill(states[2]["pid"], signal.SIGSTOP)
        text = _until_verdict(proc, "stopped")
        verdict_line = text.splitlines()[-1]
        assert verdict_line.startswith("verdict: rank 2 is stopped"), text
        assert "last seen at job.py:6 (time.sleep(300))" in verdict_line, text
        assert "ranks 0, 1 and 3 wait for it in all_reduce #4" in verdict_line, text
        row = next(line for line in text.splitlines() if line.strip().startswith("2 "))
        assert "[stopped]" in row, text
        seen = _status(run_id)
        assert "rank 2 is stopped" in seen and "job.py:6" in seen, seen
    finally:
        _stop(proc)


DDP_ASLEEP = """
    import time, torch, torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    dist.init_process_group("tcoll")
    torch.manual_seed(0)
    model = DDP(torch.nn.Linear(4, 2))
    for step in range(5):
        loss = model(torch.ones(3, 4)).sum()
        if dist.get_rank() == 1 and step == 3:
            time.sleep(300)
        loss.backward()
    dist.destroy_process_group()
"""


@pytest.mark.timeout(120)
def test_a_ddp_rank_asleep_before_its_backward_is_named_with_its_line(tmp_path: Path) -> None:
    # DDP on the tcoll backend: rank 0 waits in the gradients' all_reduce, which DDP starts from inside
    # backward(); its row names the user's backward line, rank 1's its sleep.
    pytest.importorskip("torch")
    run_id = f"hangddp{os.getpid()}"
    proc = _start(tmp_path, DDP_ASLEEP, 2, run_id, TCOLL_HANG_REPORT="2")
    try:
        text = _until_verdict(proc, "time.sleep")  # a slow start (importing torch) may be reported first
        found = re.search(r"verdict: rank 1 has made no call since all_reduce #(\d+), and is at job\.py:9 "
                          r"\(time\.sleep\(300\)\); rank 0 waits for it in all_reduce #(\d+)$", text.strip())
        assert found and int(found[2]) == int(found[1]) + 1, text
        row = next(line for line in text.splitlines() if line.strip().startswith("0 "))
        assert "job.py:10 (loss.backward())" in row, text
        assert "rank 1 has made no call since" in _status(run_id)
    finally:
        _stop(proc)


TWO_HOSTS = """
    import time, numpy as np, tcoll
    comm = tcoll.init()
    x = np.ones(4)
    for i in range(5):
        if comm.rank == 3 and i == 3:
            time.sleep(300)
        comm.all_reduce(x)
"""


@pytest.mark.timeout(120)
@pytest.mark.skipif(netns.unavailable() is not None, reason=str(netns.unavailable()))
@pytest.mark.xdist_group(netns.GROUP)
def test_a_job_on_two_hosts_is_reported_whole_by_node_0(tmp_path: Path) -> None:
    # Two namespace-hosts of two ranks each, each host with its own directory of published states (the hosts
    # share /tmp here, unlike real ones): node 0's report, and `tcoll status` on node 0's host, show host 1's rows
    # too, sent by node 1's launcher.
    (tmp_path / "job.py").write_text(textwrap.dedent(TWO_HOSTS).lstrip())
    run_id = f"hanghosts{os.getpid()}"
    with netns.namespace_hosts(2) as hosts:
        launchers = []
        for host in range(2):
            runtime = tmp_path / f"runtime{host}"
            runtime.mkdir(mode=0o700)
            args = [sys.executable, "-m", "tcoll", "run", "--nnodes", "2", "--node-rank", str(host), "--master",
                    f"{hosts.addrs[0]}:29500", "-n", "2", "--run-id", run_id, str(tmp_path / "job.py")]
            launchers.append(hosts.start(host, args, env={"XDG_RUNTIME_DIR": str(runtime), "TCOLL_HANG_REPORT": "2",
                                                          "TCOLL_STATUS": "0.25", "TCOLL_TIMEOUT": "120"}, cwd=tmp_path))
        lines = []
        assert launchers[0].stdout is not None
        for line in launchers[0].stdout:  # up to the verdict on the sleep (a slow start may be reported first)
            lines = [] if line.startswith("tcoll: hang report") else lines
            lines.append(line)
            if line.startswith("verdict:") and "time.sleep" in line:
                break
        text = "".join(lines)
        seen = subprocess.run(hosts.command(0, [sys.executable, "-m", "tcoll", "status", "--job", run_id]),
                              env=_env(XDG_RUNTIME_DIR=str(tmp_path / "runtime0")), capture_output=True, text=True,
                              timeout=30, check=False)
    assert "(4 of 4 ranks published" in text, text
    assert ("verdict: rank 3 has made no call since all_reduce #3, and is at job.py:6 (time.sleep(300)); "
            "ranks 0, 1 and 2 wait for it in all_reduce #4") in text, text
    rows = [line.split() for line in text.splitlines() if line.startswith("  ") and line.split()[0].isdigit()]
    assert [row[0] for row in rows] == ["0", "1", "2", "3"], text
    assert all("job.py:7" in " ".join(row) for row in rows[:3]), text
    assert seen.returncode == 0, seen.stderr  # on node 0's host, from another shell: the whole job too
    assert "(4 of 4 ranks published" in seen.stdout and text.splitlines()[-1] in seen.stdout, seen.stdout


# -- the verdict's rules, on published states ---------------------------------------------------


def _state(rank: int, *, sequence: int = 3, call: int | None = None, peers: list[int] | None = None,
           what: str = "all_reduce #4 (shm)", detail: str = "", where: str = "job.py:9", code: str = "") -> dict:
    comm = {"size": 3, "rank": rank, "sequence": sequence, "last": "all_reduce",
            "call": None if call is None else {"label": "all_reduce", "sequence": call, "algorithm": "ring",
                                               "bytes": 16}}
    waiting = None if peers is None else {"what": what, "peers": peers, "detail": detail, "since": 100.0}
    return {"rank": rank, "size": 3, "comms": [comm], "waiting": waiting, "in_tcoll": call is not None or bool(peers),
            "where": where, "code": code, "since": 100.0, "pid": 0, "host": "elsewhere"}


def test_the_verdict_follows_a_chain_to_the_rank_that_waits_for_nobody() -> None:
    states = [_state(0, sequence=4, call=4, peers=[1]), _state(1, sequence=4, call=4, peers=[2]),
              _state(2, where="job.py:5", code="compute()")]
    rows = {s["rank"]: Rank(s, 110.0) for s in states}
    assert verdict(rows, 3) == ("rank 2 has made no call since all_reduce #3, and is at job.py:5 (compute()); "
                                "ranks 0 and 1 wait for it in all_reduce #4")
    text = report("j", states, 110.0)
    assert "all_reduce #4 (ring, 16 B)" in text and "10 s" in text

    states[2] = _state(2, where="")  # published before its stack was read
    assert verdict({s["rank"]: Rank(s, 110.0) for s in states}, 3).startswith(
        "rank 2 has made no call since all_reduce #3, and is at a line not sampled yet;")


def test_a_cycle_of_collective_waits_is_a_deadlock_and_a_silent_rank_is_named() -> None:
    states = [_state(0, sequence=4, call=4, peers=[1]), _state(1, sequence=4, call=4, peers=[2]),
              _state(2, sequence=4, call=4, peers=[0])]
    assert verdict({s["rank"]: Rank(s, 110.0) for s in states}, 3) == \
        "ranks 0, 1 and 2 wait for each other (0 -> 1 -> 2 -> 0): a deadlock"
    states = [_state(0, sequence=4, call=4, peers=[2])]
    assert verdict({0: Rank(states[0], 110.0)}, 3).startswith("rank 2 has published nothing")


def test_another_hosts_rank_is_stopped_as_its_launcher_saw_it() -> None:
    # A row sent by another host's launcher (HangWatch) carries what only that host can tell: the process is stopped.
    states = [_state(0, sequence=4, call=4, peers=[1]), dict(_state(1, code="step()"), stopped=True)]
    assert verdict({s["rank"]: Rank(s, 110.0) for s in states}, 2) == (
        "rank 1 is stopped (SIGSTOP or a debugger: it does not answer), last seen at job.py:9 (step()); "
        "rank 0 waits for it in all_reduce #4")


def test_other_hosts_rows_count_while_the_launcher_that_kept_them_lives(tmp_path: Path) -> None:
    import socket

    from tcoll.launch.hangs import OTHER_HOSTS, job_states

    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                          check=True, timeout=30)
    for launcher, expected in ((os.getpid(), [1]), (int(gone.stdout), [])):
        status.write(str(tmp_path / OTHER_HOSTS), {"launcher": launcher, "host": socket.gethostname(),
                                                   "states": [_state(1)]})
        assert [s["rank"] for s in job_states("j", str(tmp_path))] == expected
        assert job_states("j", str(tmp_path), others=False) == []


def test_a_threads_stack_is_copied_so_it_can_be_read_after_the_thread_ran_on() -> None:
    """status.thread_frames copies each stack at once: read later, after its thread went on and ended, it
    still says where the thread was, and it holds none of the thread's frames."""
    import threading

    from tcoll.p2p import status

    entered, go = threading.Event(), threading.Event()

    def parked() -> None:
        entered.set()
        go.wait()

    thread = threading.Thread(target=parked)
    thread.start()
    entered.wait()
    copied = status.thread_frames()[thread.ident]
    go.set()
    thread.join()
    assert isinstance(copied, status.FrameSnapshot)
    user = status.user_frame(copied)
    assert user.f_code.co_name == "parked" and status.source_line(user) == "go.wait()"
    assert status.stack_top(copied)[0].endswith("in wait") and not status.in_tcoll(copied)
    assert status.frames_of(copied)[-1]["name"] == "_bootstrap"


def test_a_stack_in_a_module_under_a_non_ascii_path_keeps_its_names(tmp_path: Path, monkeypatch: Any) -> None:
    """faulthandler's dump writes non-ASCII characters as escapes; the snapshot turns them back, so the line
    is found and the frame is the user's. With no memfd to dump into, a temporary file serves."""
    import importlib.util
    import threading

    folder = tmp_path / "josé_ß"
    folder.mkdir()
    (folder / "parked_módulo.py").write_text("def parked(entered, go):\n    entered.set()\n    go.wait()\n")
    spec = importlib.util.spec_from_file_location("parked_modulo", folder / "parked_módulo.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)

    def refused(name: str, flags: int = 0) -> int:
        raise OSError(38, "Function not implemented")

    monkeypatch.setattr(os, "memfd_create", refused, raising=False)
    entered, go = threading.Event(), threading.Event()
    thread = threading.Thread(target=module.parked, args=(entered, go))
    thread.start()
    entered.wait()
    try:
        copied = status.thread_frames()[thread.ident]
    finally:
        go.set()
        thread.join()
    user = status.user_frame(copied)
    assert user.f_code.co_filename == str(folder / "parked_módulo.py")
    assert user.f_code.co_name == "parked" and status.source_line(user) == "go.wait()"
    assert not status.in_tcoll(copied)
