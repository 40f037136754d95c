"""The examples run under the launcher, print what they should, and clean up after themselves.

examples/ring.py is the README's demo; examples/collectives/*.py are the six
collectives of the torch.distributed walk-through, whose printed values are
checked against NumPy; examples/sgd.py trains data-parallel and checks itself
against training in one process; examples/heat.py trades halos by sendrecv and
checks itself against one process; examples/elastic.py loses a rank mid-step
and its survivors finish, checked against one process.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import uuid
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest
from helpers.procs import load_script

ROOT = Path(__file__).resolve().parents[1]


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    return subprocess.run([sys.executable, "-m", "tcoll", "run", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=240)


def _tcoll_segments() -> set[str]:
    return {name for name in os.listdir("/dev/shm") if name.startswith("tcoll-")}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("nprocs,mib", [(1, "1"), (3, "4"), (8, "8")])
def test_ring_example(nprocs: int, mib: str) -> None:
    result = _run_own(nprocs, "examples/ring.py", "--mib", mib)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    for rank in range(nprocs):
        assert any(line.startswith(f"[{rank}] ok: {nprocs - 1} hops checked") for line in lines), result.stdout
    if nprocs > 1:
        assert "transport shm" in result.stdout


def _run_own(nprocs: int, *args: str) -> subprocess.CompletedProcess[str]:
    """`tcoll run -n nprocs ...` under a run id of its own; asserts that none of its segments are left.

    (Segments of the run id only: other tests may be running meanwhile, with segments of their own.)
    """
    run_id = f"examples_{uuid.uuid4().hex[:12]}"
    result = _run("-n", str(nprocs), "--run-id", run_id, *args)
    assert not {name for name in _tcoll_segments() if name.startswith(f"tcoll-{run_id}-")}
    return result


# -- examples/collectives: the seed's six collectives -----------------------------------------

_DATA_LINE = re.compile(r"^\[(\d+)\] data = (.*)$")


def _printed_data(stdout: str) -> dict[int, str]:
    """{rank: what it printed after "data ="}, from lines "[r] data = ..." (the seed's prefix, not doubled)."""
    printed: dict[int, str] = {}
    for line in stdout.splitlines():
        assert not re.match(r"^\[\d+\] \[\d+\] ", line), f"doubled prefix: {line!r}"
        match = _DATA_LINE.match(line)
        if match is None:
            continue
        rank, value = int(match[1]), match[2]
        assert rank not in printed, f"rank {rank} printed twice:\n{stdout}"
        printed[rank] = value
    return printed


def _reduce(size: int) -> dict[int, str]:
    ones = np.ones((size, 1), dtype=np.float32)  # rank r's array is ones[r]
    total = ones.sum(axis=0)
    return {r: str(total[0] if r == 0 else ones[r][0]) for r in range(size)}  # others keep their own


def _all_reduce(size: int) -> dict[int, str]:
    total = np.ones((size, 1), dtype=np.float32).sum(axis=0)
    return {r: str(total[0]) for r in range(size)}


def _scatter(size: int) -> dict[int, str]:
    chunks = np.arange(1, size + 1, dtype=np.float32).reshape(size, 1)
    return {r: str(chunks[r][0]) for r in range(size)}


def _gather(size: int) -> dict[int, str]:
    rows = np.stack([np.array([r], dtype=np.float32) for r in range(size)])
    return {0: str(rows.ravel())}


def _all_gather(size: int) -> dict[int, str]:
    rows = np.stack([np.array([r], dtype=np.float32) for r in range(size)])
    return {r: str(rows.ravel()) for r in range(size)}


def _broadcast(size: int) -> dict[int, str]:
    return {r: str(np.array([0], dtype=np.float32)) for r in range(size)}


_COLLECTIVES: dict[str, Callable[[int], dict[int, str]]] = {
    "reduce": _reduce, "all_reduce": _all_reduce, "scatter": _scatter,
    "gather": _gather, "all_gather": _all_gather, "broadcast": _broadcast,
}


def test_collective_expectations_are_the_seeds() -> None:
    """With 4 ranks the expectations are the values the torch.distributed walk-through prints."""
    assert _reduce(4)[0] == "4.0" and _all_reduce(4) == {r: "4.0" for r in range(4)}
    assert _scatter(4) == {0: "1.0", 1: "2.0", 2: "3.0", 3: "4.0"}
    assert _gather(4) == {0: "[0. 1. 2. 3.]"} and _all_gather(4)[3] == "[0. 1. 2. 3.]"
    assert _broadcast(4) == {r: "[0.]" for r in range(4)}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("nprocs", [4, 3])
@pytest.mark.parametrize("name", list(_COLLECTIVES))
def test_collective_example(name: str, nprocs: int) -> None:
    result = _run_own(nprocs, f"examples/collectives/{name}.py")
    assert result.returncode == 0, result.stderr
    assert _printed_data(result.stdout) == _COLLECTIVES[name](nprocs), result.stdout


# -- examples/sgd.py: data-parallel SGD checked against one process -----------------------------

_EPOCH_LINE = re.compile(r"^(?:\[0\] )?epoch +(\d+): loss (\d+\.\d+) \(single process (\d+\.\d+)\)$")
_SGD_DEFAULTS = argparse.Namespace(epochs=20, batch_size=64, lr=0.5, seed=0)  # the script's defaults


def _sgd_module() -> ModuleType:
    """examples/sgd.py imported as a module (its training loop runs without a communicator)."""
    return load_script(ROOT / "examples" / "sgd.py", "tcoll_example_sgd")


@pytest.fixture(scope="module")
def sgd_reference() -> list[float]:
    """The per-epoch mean losses of training in this process on whole batches."""
    sgd = _sgd_module()
    X, y = sgd.make_data(_SGD_DEFAULTS.seed)
    params, losses = sgd.train(X, y, _SGD_DEFAULTS)
    assert np.mean((sgd.forward(params, X)[1] > 0) == y) > 0.9  # the model does learn the task
    return losses


def _check_sgd_output(stdout: str, nprocs: int, reference: list[float]) -> None:
    epochs = [m for m in map(_EPOCH_LINE.match, stdout.splitlines()) if m is not None]
    assert [int(m[1]) for m in epochs] == list(range(1, len(reference) + 1)), stdout
    printed = np.array([float(m[2]) for m in epochs])
    printed_ref = np.array([float(m[3]) for m in epochs])
    assert np.allclose(printed, reference, rtol=0, atol=1e-6), stdout  # printed with 6 decimals
    assert np.allclose(printed_ref, reference, rtol=0, atol=1e-6), stdout
    assert printed[-1] < 0.5 * printed[0], stdout
    assert f"weights agree on all {nprocs} rank(s)" in stdout
    assert "weights match single-process training" in stdout


@pytest.mark.timeout(90)
@pytest.mark.parametrize("nprocs", [4, 3])  # 64-sample batches: 16 per rank, or 22/21/21
def test_sgd_example(nprocs: int, sgd_reference: list[float]) -> None:
    result = _run_own(nprocs, "examples/sgd.py", "--check")
    assert result.returncode == 0, result.stderr
    _check_sgd_output(result.stdout, nprocs, sgd_reference)
    assert all(line.startswith("[0] ") for line in result.stdout.splitlines()), result.stdout  # rank 0 reports


@pytest.mark.timeout(60)
def test_sgd_example_single_process(sgd_reference: list[float]) -> None:
    """Without a launcher the script is a world of one rank."""
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    result = subprocess.run([sys.executable, "examples/sgd.py", "--check"], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=50, check=False)
    assert result.returncode == 0, result.stderr
    _check_sgd_output(result.stdout, 1, sgd_reference)
    assert "trained on 1 rank(s)" in result.stdout


# -- examples/elastic.py: a rank dies mid-step, the survivors shrink and finish ---------------------


@pytest.mark.timeout(120)
@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_elastic_example_finishes_without_the_rank_that_died(transport: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TCOLL_TRANSPORT", transport)
    result = _run_own(4, "--keep-going", "examples/elastic.py", "--check")
    assert result.returncode == 137, result.stderr  # a rank died: the launcher says so in its exit code
    assert "rank 2" in result.stderr and "killed by SIGKILL" in result.stderr, result.stderr
    out = result.stdout
    assert "check: 3 survivors of 4; largest difference from one process" in out and "(OK)" in out, out
    for rank in (0, 1, 3):  # the death itself, or another survivor's revoke if that came first
        assert re.search(rf"rank {rank}: step 17: (PeerLostError: peer rank 2 is lost|RevokedError)", out), out
    assert sorted(re.findall(r"\(now (\d) of 3\)", out)) == ["0", "1", "2"], out


# -- examples/heat.py: a halo exchange by sendrecv, checked against one process ------------------


@pytest.mark.timeout(120)
@pytest.mark.parametrize("nprocs", [1, 3, 4])
def test_heat_example(nprocs: int) -> None:
    result = _run_own(nprocs, "examples/heat.py", "--points", "101", "--steps", "1500")
    assert result.returncode == 0, result.stderr
    assert f"on {nprocs} rank(s): matches one process exactly" in result.stdout, result.stdout


# -- benchmarks/*.py that the docs quote: they run, and print every row --------------------------


@pytest.mark.timeout(120)
def test_call_profile_and_p2p_buffers_benchmarks_run() -> None:
    """benchmarks/call_profile.py and p2p_buffers.py, cut short (their tables are in docs/performance.md)."""
    result = _run_own(2, "benchmarks/p2p_buffers.py", "--trips", "200", "--rounds", "1")
    assert result.returncode == 0, result.stderr
    for kind in ["numpy float32", "numpy bfloat16", "bytearray", "torch float32", "torch bfloat16"]:
        assert f"| {kind} | " in result.stdout, result.stdout
    result = _run_own(2, "benchmarks/call_profile.py", "--calls", "50")
    assert result.returncode == 0, result.stderr
    for what in ["p2p send+recv:", "all_reduce:", "all_reduce plan:"]:
        assert what in result.stdout, result.stdout


@pytest.mark.timeout(120)
def test_user_loop_benchmark_runs() -> None:
    """benchmarks/user_loop.py, cut short: a row per size and kind of buffer (it checks each result itself)."""
    result = _run_own(2, "benchmarks/user_loop.py", "--sizes", "64K,1M", "--repeats", "1", "--markdown")
    assert result.returncode == 0, result.stderr
    for row in ["| 65536 | plain | ", "| 65536 | shm | ", "| 1048576 | plain | ", "| 1048576 | shm | "]:
        assert row in result.stdout, result.stdout
