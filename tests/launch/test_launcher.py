"""Tests of `tcoll run`: the launcher is started as ``python -m tcoll run`` on small scripts."""

from __future__ import annotations

import ctypes
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from helpers.procs import free_port

from tcoll import cli
from tcoll.launch import LaunchConfig

SRC = Path(__file__).resolve().parents[2] / "src"

# Written by every rank of the env scripts: what the contract promises.
CONTRACT = ["TCOLL_RANK", "TCOLL_SIZE", "TCOLL_LOCAL_RANK", "TCOLL_LOCAL_SIZE", "TCOLL_NODE_RANK",
            "TCOLL_NNODES", "TCOLL_MASTER", "TCOLL_STORE_HOSTED", "TCOLL_RUN_ID", "RANK", "WORLD_SIZE",
            "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT", "PYTHONUNBUFFERED"]

ENV_SCRIPT = f"""
    import json, os, sys
    keys = {CONTRACT!r}
    rank = os.environ["RANK"]
    with open(f"env{{rank}}.json", "w") as f:
        json.dump({{k: os.environ.get(k) for k in keys}}, f)
"""

# Writes its pid, then waits until every rank has (the failing rank of a test
# must not fail before the others run); a rank then waits forever with pause().
PAUSE = """
    import os, pathlib, signal, time
    pathlib.Path(f"pid{os.environ['RANK']}.tmp").write_text(str(os.getpid()))
    os.rename(f"pid{os.environ['RANK']}.tmp", f"pid{os.environ['RANK']}")
    deadline = time.monotonic() + 20
    while not all(pathlib.Path(f"pid{r}").exists() for r in range(int(os.environ["WORLD_SIZE"]))):
        assert time.monotonic() < deadline, "the other ranks did not start"
        time.sleep(0.01)
"""


def _env() -> dict[str, str]:
    """The test environment, with tcoll importable and no launcher variables inherited."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TCOLL_")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(SRC), env.get("PYTHONPATH", "")) if p)
    return env


def script(tmp_path: Path, body: str, name: str = "job.py") -> str:
    """Write a script into tmp_path and return its name (the launcher runs in tmp_path)."""
    (tmp_path / name).write_text(textwrap.dedent(body))
    return name


def run(tmp_path: Path, *args: str, timeout: float = 45) -> subprocess.CompletedProcess[str]:
    """Run ``python -m tcoll run ARGS`` in tmp_path to the end."""
    return subprocess.run([sys.executable, "-m", "tcoll", "run", *args], check=False, cwd=tmp_path, env=_env(),
                          capture_output=True, text=True, timeout=timeout)


def start(tmp_path: Path, *args: str) -> subprocess.Popen[str]:
    """Start ``python -m tcoll run ARGS`` in tmp_path without waiting."""
    return subprocess.Popen([sys.executable, "-m", "tcoll", "run", *args], cwd=tmp_path, env=_env(),
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_for(predicate: Callable[[], bool], timeout: float = 20.0) -> None:
    """Poll `predicate` until it holds, failing the test after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.02)


def pids(tmp_path: Path, ranks: range) -> list[int]:
    """Wait for the pid files of `ranks` and return the pids."""
    files = [tmp_path / f"pid{r}" for r in ranks]
    wait_for(lambda: all(f.exists() for f in files))
    return [int(f.read_text()) for f in files]


def assert_gone(pid: int) -> None:
    """Assert a process no longer exists: neither running nor an unreaped zombie."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return
    state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    pytest.fail(f"process {pid} still exists (state {state})")


@pytest.fixture
def reaper() -> Iterator[Callable[[int], int]]:
    """Adopt the orphans of this test (a killed launcher's ranks, a rank's children) and reap them.

    Without this their zombies would go to init, which in a container may never
    reap them. Yields `reap(pid)`: wait until that orphan dies and return its
    wait status (blocking: a process that never dies fails the test by timeout).
    """
    prctl = ctypes.CDLL(None, use_errno=True).prctl
    prctl(36, 1)  # PR_SET_CHILD_SUBREAPER

    def reap(pid: int) -> int:
        return os.waitpid(pid, 0)[1]

    yield reap
    prctl(36, 0)


def finish(proc: subprocess.Popen[str], timeout: float = 30) -> tuple[int, str, str]:
    """Wait for a started launcher; kill it if it hangs, so no test leaves it running."""
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        pytest.fail(f"launcher did not exit in time; stderr:\n{err}")
    return proc.returncode, out, err


# -- command line -------------------------------------------------------------------------


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    import tcoll

    assert cli.main(["--version"]) == 0
    assert capsys.readouterr().out == f"tcoll {tcoll.__version__}\n"


@pytest.mark.timeout(60)
def test_a_prefix_the_rank_printed_itself_is_not_doubled(tmp_path: Path) -> None:
    body = """
        import os
        print(f"[{os.environ['RANK']}] data = 4.0")
        print("plain")
    """
    result = run(tmp_path, "-n", "2", script(tmp_path, body))
    assert result.returncode == 0, result.stderr
    assert sorted(result.stdout.splitlines()) == ["[0] data = 4.0", "[0] plain", "[1] data = 4.0", "[1] plain"]


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("argv", "command", "nprocs"), [
    (["-n", "2", "s.py", "--foo", "-n", "3"], ["s.py", "--foo", "-n", "3"], 2),
    (["--nprocs=4", "-m", "pkg.mod", "-n", "1", "--x"], ["-m", "pkg.mod", "-n", "1", "--x"], 4),
    (["--", "s.py", "-h"], ["s.py", "-h"], 1),
])
def test_cli_passes_script_arguments_untouched(monkeypatch: pytest.MonkeyPatch, argv: list[str],
                                               command: list[str], nprocs: int) -> None:
    seen: list[LaunchConfig] = []
    monkeypatch.setattr("tcoll.launch.runner.launch", lambda config: seen.append(config) or 0)
    assert cli.main(["run", *argv]) == 0
    assert seen[0].command == command and seen[0].nprocs == nprocs


@pytest.mark.timeout(60)
def test_no_script_prints_usage_and_exits_2(tmp_path: Path) -> None:
    result = run(tmp_path)
    assert result.returncode == 2
    assert "usage: tcoll run" in result.stderr


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("args", "message"), [
    (["missing.py"], "script not found: missing.py"),
    (["--run-id", "a-b", "x.py"], "run id 'a-b'"),
    (["--nnodes", "2", "x.py"], "--master"),
])
def test_bad_invocations_exit_2_with_a_clear_message(tmp_path: Path, args: list[str], message: str) -> None:
    script(tmp_path, "", "x.py")
    result = run(tmp_path, *args)
    assert result.returncode == 2
    assert message in result.stderr


@pytest.mark.timeout(60)
def test_bench_without_its_module_says_so(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cli, "_BENCH_MODULE", "tcoll.no_such_bench_module")
    assert cli.main(["bench", "p2p"]) == 2
    assert "tcoll bench: not available" in capsys.readouterr().err


# -- one node -----------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_every_rank_gets_the_environment_contract(tmp_path: Path) -> None:
    result = run(tmp_path, "-n", "3", script(tmp_path, ENV_SCRIPT))
    assert result.returncode == 0, result.stderr
    envs = [json.loads((tmp_path / f"env{r}.json").read_text()) for r in range(3)]
    master_host, store_port = envs[0]["TCOLL_MASTER"].rsplit(":", 1)
    for rank, env in enumerate(envs):
        assert env["RANK"] == env["TCOLL_RANK"] == env["LOCAL_RANK"] == env["TCOLL_LOCAL_RANK"] == str(rank)
        assert env["WORLD_SIZE"] == env["TCOLL_SIZE"] == env["LOCAL_WORLD_SIZE"] == env["TCOLL_LOCAL_SIZE"] == "3"
        assert env["GROUP_RANK"] == env["TCOLL_NODE_RANK"] == "0" and env["TCOLL_NNODES"] == "1"
        assert env["TCOLL_STORE_HOSTED"] == env["PYTHONUNBUFFERED"] == "1"
        assert env["MASTER_ADDR"] == master_host == "127.0.0.1"
        assert env["TCOLL_MASTER"] == envs[0]["TCOLL_MASTER"] and env["MASTER_PORT"] == envs[0]["MASTER_PORT"]
        assert env["TCOLL_RUN_ID"] == envs[0]["TCOLL_RUN_ID"]
    assert envs[0]["MASTER_PORT"] != store_port  # torch's rank 0 binds MASTER_PORT itself
    assert len(envs[0]["TCOLL_RUN_ID"]) == 12 and int(envs[0]["TCOLL_RUN_ID"], 16) >= 0


@pytest.mark.timeout(60)
def test_output_is_prefixed_whole_lines_and_arguments_pass_through(tmp_path: Path) -> None:
    body = """
        import os, sys
        print("args", sys.argv[1:])
        sys.stdout.write("no newline at the end")
        print("err", os.environ["RANK"], file=sys.stderr)
    """
    result = run(tmp_path, "-n", "2", script(tmp_path, body), "--foo", "-n", "3")
    assert result.returncode == 0, result.stderr
    for rank in range(2):
        assert f"[{rank}] args ['--foo', '-n', '3']\n" in result.stdout
        assert f"[{rank}] no newline at the end\n" in result.stdout
        assert f"[{rank}] err {rank}\n" in result.stderr
    assert all(line.startswith(("[0] ", "[1] ")) for line in result.stdout.splitlines())


@pytest.mark.timeout(60)
def test_no_prefix_and_module_mode(tmp_path: Path) -> None:
    script(tmp_path, "import sys\nprint('module', sys.argv[1:])\n", "mymod.py")
    result = run(tmp_path, "-n", "2", "--no-prefix", "-m", "mymod", "-x")
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["module ['-x']"] * 2


@pytest.mark.timeout(60)
def test_a_raising_rank_fails_the_job_quickly_with_its_traceback(tmp_path: Path) -> None:
    body = PAUSE + """
    if os.environ["RANK"] == "1":
        raise ValueError("boom from rank one")
    signal.pause()
    """
    began = time.monotonic()
    result = run(tmp_path, "-n", "3", script(tmp_path, body))
    assert time.monotonic() - began < 10
    assert result.returncode == 1
    assert "tcoll run: rank 1 (pid " in result.stderr and "exited with code 1" in result.stderr
    report = result.stderr[result.stderr.index("tcoll run: rank 1"):]
    assert "ValueError: boom from rank one" in report.splitlines()[0]  # the failure named in one line
    assert result.stderr.count("Traceback (most recent call last)") == 1  # forwarded once, not repeated
    assert result.stderr.count("[1] Traceback (most recent call last)") == 1
    for pid in pids(tmp_path, range(3)):
        assert_gone(pid)


@pytest.mark.timeout(60)
def test_the_exit_code_of_the_failing_rank_is_the_launchers(tmp_path: Path) -> None:
    body = PAUSE + """
    if os.environ["RANK"] == "0":
        raise SystemExit(3)
    signal.pause()
    """
    result = run(tmp_path, "-n", "2", script(tmp_path, body))
    assert result.returncode == 3
    assert "rank 0" in result.stderr and "exited with code 3" in result.stderr
    for pid in pids(tmp_path, range(2)):
        assert_gone(pid)


@pytest.mark.timeout(60)
def test_a_rank_killed_by_sigkill_gives_137_and_stops_the_others(tmp_path: Path) -> None:
    body = PAUSE + """
    if os.environ["RANK"] == "2":
        os.kill(os.getpid(), signal.SIGKILL)
    signal.pause()
    """
    result = run(tmp_path, "-n", "3", script(tmp_path, body))
    assert result.returncode == 137
    assert "rank 2" in result.stderr and "was killed by SIGKILL" in result.stderr
    for pid in pids(tmp_path, range(3)):
        assert_gone(pid)


@pytest.mark.timeout(60)
def test_the_children_of_a_rank_are_stopped_too(tmp_path: Path, reaper: Callable[[int], int]) -> None:
    body = PAUSE + """
    import subprocess, sys
    child = subprocess.Popen([sys.executable, "-c", "import signal; signal.pause()"])
    pathlib.Path("grandchild").write_text(str(child.pid))
    raise SystemExit(4)
    """
    result = run(tmp_path, "-n", "1", script(tmp_path, body))
    assert result.returncode == 4
    status = reaper(int((tmp_path / "grandchild").read_text()))  # orphaned: adopted by this test
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("signum", "code"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_signal_to_the_launcher_stops_every_rank(tmp_path: Path, signum: int, code: int) -> None:
    stubborn = """
    import os, signal
    if os.environ["RANK"] == "0":  # only SIGKILL, after the grace period, stops this rank
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    """
    body = stubborn + PAUSE + "    signal.pause()\n"
    launcher = start(tmp_path, "-n", "3", "--grace", "1", script(tmp_path, body))
    ranks = pids(tmp_path, range(3))
    launcher.send_signal(signum)
    returncode, _, err = finish(launcher)
    assert returncode == code
    assert f"received {signal.Signals(signum).name}" in err
    for pid in ranks:
        assert_gone(pid)


@pytest.mark.timeout(60)
def test_shared_memory_of_the_run_is_removed(tmp_path: Path) -> None:
    other = Path(f"/dev/shm/tcoll-testrun42x{os.getpid()}-keep")  # a run whose id starts alike
    other.write_bytes(b"x")
    body = """
        import os, pathlib, sys
        pathlib.Path(f"/dev/shm/tcoll-{os.environ['TCOLL_RUN_ID']}-seg{os.environ['RANK']}").write_bytes(b"x")
        sys.exit(int(os.environ["RANK"]) * 2)
    """
    try:
        result = run(tmp_path, "-n", "2", "--run-id", "testrun42", script(tmp_path, body))
        assert result.returncode == 2
        assert not [p for p in os.listdir("/dev/shm") if p.startswith("tcoll-testrun42-")]
        assert other.exists()  # another run's segments are not touched, even with a similar id
    finally:
        other.unlink()


@pytest.mark.timeout(60)
def test_killing_the_launcher_kills_its_ranks(tmp_path: Path, reaper: Callable[[int], int]) -> None:
    launcher = start(tmp_path, "-n", "2", script(tmp_path, PAUSE + "    signal.pause()\n"))
    ranks = pids(tmp_path, range(2))
    launcher.kill()
    finish(launcher)
    for pid in ranks:  # orphaned, so adopted by this test: they die of the launcher's death
        status = reaper(pid)
        assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL


# -- several nodes ------------------------------------------------------------------------


def _nodes(tmp_path: Path, name: str, *extra: str) -> tuple[subprocess.Popen[str], subprocess.Popen[str], int]:
    """Start two launchers of 2 ranks each, node 0 and node 1, on this machine."""
    port = free_port(span=2)  # the launcher's rendezvous takes port + 1
    common = ["-n", "2", "--nnodes", "2", "--master", f"127.0.0.1:{port}", "--grace", "1", *extra]
    node0 = start(tmp_path, *common, "--node-rank", "0", name)
    node1 = start(tmp_path, *common, "--node-rank", "1", name)
    return node0, node1, port


@pytest.mark.timeout(60)
def test_two_launchers_form_one_world(tmp_path: Path) -> None:
    node0, node1, port = _nodes(tmp_path, script(tmp_path, ENV_SCRIPT))
    (code0, _, err0), (code1, _, err1) = finish(node0), finish(node1)
    assert code0 == 0 and code1 == 0, err0 + err1
    envs = [json.loads((tmp_path / f"env{r}.json").read_text()) for r in range(4)]
    for rank, env in enumerate(envs):
        assert env["RANK"] == env["TCOLL_RANK"] == str(rank) and env["WORLD_SIZE"] == env["TCOLL_SIZE"] == "4"
        assert env["LOCAL_RANK"] == str(rank % 2) and env["LOCAL_WORLD_SIZE"] == "2"
        assert env["GROUP_RANK"] == env["TCOLL_NODE_RANK"] == str(rank // 2) and env["TCOLL_NNODES"] == "2"
        assert env["TCOLL_MASTER"] == f"127.0.0.1:{port}" and env["MASTER_PORT"] == str(port + 1)
        assert env["TCOLL_RUN_ID"] == envs[0]["TCOLL_RUN_ID"]  # node 1 adopted node 0's run id


@pytest.mark.timeout(60)
def test_a_failure_on_node_1_stops_node_0(tmp_path: Path) -> None:
    body = PAUSE + """
    if os.environ["RANK"] == "3":
        raise SystemExit(5)
    signal.pause()
    """
    node0, node1, _ = _nodes(tmp_path, script(tmp_path, body))
    (code0, _, err0), (code1, _, err1) = finish(node0), finish(node1)
    assert code1 == 5 and "rank 3" in err1
    assert code0 == 5 and "rank 3 on node 1 failed" in err0
    for pid in pids(tmp_path, range(4)):
        assert_gone(pid)


@pytest.mark.timeout(60)
def test_losing_node_0_stops_node_1(tmp_path: Path, reaper: Callable[[int], int]) -> None:
    node0, node1, _ = _nodes(tmp_path, script(tmp_path, PAUSE + "    signal.pause()\n"))
    ranks = pids(tmp_path, range(4))
    node0.kill()  # no goodbye: the store vanishes with it
    code0, _, _ = finish(node0)
    code1, _, err1 = finish(node1)
    assert code0 == -signal.SIGKILL
    assert code1 == 1 and "lost the tcoll store" in err1
    for pid in ranks[2:]:
        assert_gone(pid)
    for pid in ranks[:2]:  # node 0's ranks die with their launcher
        reaper(pid)


_ECHO_FIRST = """
    import os, pathlib, time
    import tcoll
    rank = int(os.environ["RANK"])
    if rank == 0:
        pathlib.Path("pid0").write_text(str(os.getpid()))
        raise tcoll.PeerLostError(1, "its process is gone")
    deadline = time.monotonic() + 20
    while not pathlib.Path("pid0").exists() or _running(int(pathlib.Path("pid0").read_text() or 0)):
        assert time.monotonic() < deadline
        time.sleep(0.01)
    raise ValueError("the cause of it all")
"""

_RUNNING = """
def _running(pid):
    try:
        state = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")
"""


@pytest.mark.timeout(60)
def test_the_cause_is_reported_not_the_first_rank_to_exit(tmp_path: Path) -> None:
    """Rank 0 exits first with a PeerLostError (an echo); rank 1's ValueError is what the launcher reports."""
    name = script(tmp_path, _RUNNING + textwrap.dedent(_ECHO_FIRST))
    done = run(tmp_path, "-n", "2", name)
    assert done.returncode == 1
    report = [line for line in done.stderr.splitlines() if line.startswith("tcoll run: rank")]
    assert report and report[0].startswith("tcoll run: rank 1 "), done.stderr


# -- what a mismatch prints ------------------------------------------------------------------------

_MISMATCH = """
    import numpy as np
    import tcoll
    comm = tcoll.init()
    x = np.ones(4, dtype=np.float32 if comm.rank == comm.size - 1 else np.int32)
    comm.all_reduce(x)
    comm.close()
"""


@pytest.mark.timeout(90)
@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_a_mismatch_prints_one_short_message_per_rank(tmp_path: Path, transport: str) -> None:
    """Each rank: where the user called, then the error naming the call and the ranks; then the launcher's line."""
    name = script(tmp_path, _MISMATCH)
    env = {**_env(), "TCOLL_TRANSPORT": transport}
    done = subprocess.run([sys.executable, "-m", "tcoll", "run", "-n", "3", name], check=False, cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=80)
    lines = done.stderr.splitlines()
    assert done.returncode == 1 and len(lines) < 30, done.stderr
    assert "Traceback" not in done.stderr and "tcoll/comm/" not in done.stderr, done.stderr
    summary = [line for line in lines if line.startswith("tcoll run: rank")]
    assert len(summary) == 1 and "MismatchError: all_reduce #1" in summary[0], done.stderr
    errors = [line for line in lines if "MismatchError:" in line and not line.startswith("tcoll run")]
    assert errors and all("all_reduce(float32)" in line and "all_reduce(int32)" in line for line in errors), lines
    assert all("rank 2 called" in line for line in errors), lines
    for line in errors:  # each rank's error comes after the line of the user's call
        at = lines[lines.index(line) - 1]
        assert at.endswith(f"{name}, line 6: comm.all_reduce(x)") and at.startswith(line[:4]), (at, line)


@pytest.mark.timeout(60)
def test_full_tracebacks_on_request_and_for_other_errors(tmp_path: Path) -> None:
    name = script(tmp_path, _MISMATCH)
    env = {**_env(), "TCOLL_TRACEBACK": "full"}
    done = subprocess.run([sys.executable, "-m", "tcoll", "run", "-n", "2", name], check=False, cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=50)
    assert done.returncode == 1 and "Traceback (most recent call last)" in done.stderr, done.stderr
    assert "tcoll/comm/" in done.stderr, done.stderr


def _fold(text: str) -> str:
    from tcoll.launch.output import Tracebacks

    folder = Tracebacks()
    out = [piece for line in text.splitlines(keepends=True) for piece in folder.feed(line.encode())]
    return b"".join(out + folder.flush()).decode()


_TCOLL_FILE = str(SRC / "tcoll" / "comm" / "dispatch.py")
_CHAIN = f"""tcoll.errors.MismatchError: recv from rank 1 (tag 112): rank 1 sent a message of another call

The above exception was the direct cause of the following exception:

Traceback (most recent call last):
  File "/home/me/job.py", line 9, in <module>
    main()
  File "/home/me/job.py", line 6, in main
    comm.all_reduce(x)
  File "{_TCOLL_FILE}", line 141, in _run_prepared
    raise cause from exc
tcoll.errors.MismatchError: all_reduce #1: rank 1 called all_reduce(int32) where rank 0 called all_reduce(float32)
"""


def test_a_tcoll_traceback_folds_into_the_users_call_and_the_error() -> None:
    assert _fold(_CHAIN) == ("  at /home/me/job.py, line 6: comm.all_reduce(x)\n"
                             "tcoll.errors.MismatchError: all_reduce #1: rank 1 called all_reduce(int32) where rank 0 "
                             "called all_reduce(float32)\n")


class _Writes:
    """A Sink that records each write."""

    def __init__(self) -> None:
        self.writes: list[bytes] = []

    def write(self, data: bytes, to_stderr: bool) -> None:
        self.writes.append(data)


def test_a_folded_traceback_reaches_the_terminal_in_one_write() -> None:
    # Several ranks' forwarders share the terminal: the user's call and its error must never be split by
    # another rank's line.
    from tcoll.launch.output import LineForwarder

    read, write = os.pipe()
    sink = _Writes()
    forwarder = LineForwarder(os.fdopen(read, "rb"), sink, True, b"[2] ")  # type: ignore[arg-type]
    with os.fdopen(write, "wb") as pipe:
        pipe.write(b"hello\n" + _CHAIN.encode())
    assert forwarder.join(10)
    assert sink.writes == [b"[2] hello\n", b"[2]   at /home/me/job.py, line 6: comm.all_reduce(x)\n[2] " +
                           _CHAIN.splitlines()[-1].encode() + b"\n"]


def test_other_output_passes_unchanged() -> None:
    own = ('Traceback (most recent call last):\n  File "/home/me/job.py", line 3, in <module>\n'
           '    raise ValueError("mine")\nValueError: mine\n')
    wrapped = _CHAIN + "\nDuring handling of the above exception, another exception occurred:\n\n" + own
    plain = "hello\n\nworld\ntcoll.errors.MismatchError: printed by the user\nmore\n"
    for text in (own, wrapped, plain, own + plain, "Traceback (most recent call last):\n  File \"x\", line 1\n"):
        assert _fold(text) == text
