"""The torch examples: the seed's torch.distributed programs on "tcoll", and DDP training under two launchers.

examples/torch/*.py are the seed documents' programs with only the backend
name and their start changed (examples/torch/launching.py); they must print what
the seeds print (with 4 ranks, as there), alone (starting their ranks on a free
port) and under `tcoll run` (each copy one rank).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")


ROOT = Path(__file__).resolve().parents[2]

# What the seeds print, with 4 ranks: lines "[rank] data = ..." (the ring prints "rank tensor(...)").
_LIST = "[tensor([0.]), tensor([1.]), tensor([2.]), tensor([3.])]"
SEED_OUTPUT = {
    # the root gets the sum; torch calls the others' values undefined (gloo leaves partial sums there),
    # and tcoll's reduce leaves them as they were
    "reduce": {0: "4.0", 1: "1.0", 2: "1.0", 3: "1.0"},
    "all_reduce": {r: "4.0" for r in range(4)},
    "scatter": {0: "1.0", 1: "2.0", 2: "3.0", 3: "4.0"},
    "gather": {0: _LIST},
    "all_gather": {r: _LIST for r in range(4)},
    "broadcast": {r: "tensor([0.])" for r in range(4)},
}

def _start_seed(name: str, *launcher: str) -> subprocess.Popen[str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), OMP_NUM_THREADS="1")
    for key in ("MASTER_PORT", "RANK", "WORLD_SIZE", "PYTHONUNBUFFERED"):
        env.pop(key, None)  # unbuffered off: each process then writes its lines at exit, in one piece
    return subprocess.Popen([sys.executable, *launcher, f"examples/torch/{name}.py"], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _finish(process: subprocess.Popen[str], name: str) -> str:
    try:
        out, err = process.communicate(timeout=280)
    except subprocess.TimeoutExpired:
        process.kill()
        out, err = process.communicate()
        raise AssertionError(f"examples/torch/{name}.py did not finish:\n{out}\n{err}") from None
    assert process.returncode == 0, f"examples/torch/{name}.py failed:\n{err}"
    return out


@pytest.mark.timeout(300)
def test_seed_examples_print_what_the_seeds_print() -> None:
    """The seven seed programs, run side by side (each starts 4 processes that import torch)."""
    running = {name: _start_seed(name) for name in [*SEED_OUTPUT, "ring_all_reduce"]}
    outputs = {name: _finish(process, name) for name, process in running.items()}
    for name, want in SEED_OUTPUT.items():
        out = outputs[name]
        for rank, value in want.items():
            assert f"[{rank}] data = {value}" in out, f"{name}: {out}"  # lines of several processes may interleave
        assert out.count("data = ") == len(want), f"{name}: {out}"
    # the isend/recv ring all-reduce of [rank] * 4 over 4 ranks: every rank prints 0+1+2+3
    printed = sorted(re.findall(r"(\d) (tensor\(\[[^\]]*\]\))", outputs["ring_all_reduce"]))
    assert printed == [(str(r), "tensor([6, 6, 6, 6])") for r in range(4)], outputs["ring_all_reduce"]


@pytest.mark.timeout(240)
def test_seed_example_under_tcoll_run() -> None:
    """`tcoll run -n 4 examples/torch/all_reduce.py` (the README's line): each copy is one rank, one prefix."""
    out = _finish(_start_seed("all_reduce", "-m", "tcoll", "run", "-n", "4"), "all_reduce")
    assert sorted(out.splitlines()) == [f"[{rank}] data = 4.0" for rank in range(4)], out


def _check_ddp_output(out: str, ranks: int) -> None:
    losses = [float(m) for m in re.findall(r"epoch \d+: loss (\d+\.\d+)", out)]
    assert len(losses) == 5 and losses[-1] < 0.7 * losses[0], out
    assert f"trained on {ranks} rank(s) with backend tcoll" in out, out
    assert "weights match single-process training" in out, out


@pytest.mark.timeout(240)
def test_ddp_example_under_tcoll_run() -> None:
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), OMP_NUM_THREADS="1")
    result = subprocess.run([sys.executable, "-m", "tcoll", "run", "-n", "4", "examples/ddp_train.py", "--check"],
                            cwd=ROOT, env=env, capture_output=True, text=True, timeout=230)
    assert result.returncode == 0, result.stderr
    _check_ddp_output(result.stdout, 4)


@pytest.mark.timeout(240)
def test_ddp_example_under_torchrun() -> None:
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                             "examples/ddp_train.py", "--check"],
                            cwd=ROOT, env=env, capture_output=True, text=True, timeout=230)
    assert result.returncode == 0, result.stderr
    _check_ddp_output(result.stdout, 2)


@pytest.mark.timeout(240)
def test_allreduce_benchmark_script_runs() -> None:
    """benchmarks/torch_allreduce.py, cut short: one table with the tcoll, tcoll async, zero-copy, gloo and
    comm.all_reduce columns."""
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    result = subprocess.run([sys.executable, "benchmarks/torch_allreduce.py", "--ranks", "2", "--sizes", "8,65536",
                             "--runs", "1"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=230)
    assert result.returncode == 0, result.stderr
    rows = [line for line in result.stdout.splitlines() if line.startswith(("8 B |", "64 KiB |"))]
    assert len(rows) == 2 and all(line.count("|") == 9 and line.endswith("x") for line in rows), result.stdout


@pytest.mark.timeout(120)
def test_ddp_elastic_example_goes_on_without_the_dead_rank() -> None:
    """examples/ddp_elastic.py: the last of 3 ranks dies at step 15; the 2 others shrink, wrap DDP anew and
    finish with the weights of single-process training."""
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), OMP_NUM_THREADS="1")
    for key in ("RANK", "WORLD_SIZE", "MASTER_PORT"):
        env.pop(key, None)
    result = subprocess.run([sys.executable, "examples/ddp_elastic.py", "--check"], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=110)
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    # (the death itself, or the other survivor's revoke if that came first)
    assert re.search(r"step 15: (PeerLostError|RevokedError); rank\(s\) \[2\] dead, going on with 2 ranks", out), out
    assert "trained 40 steps, finished on 2 ranks; final loss" in out, out
    assert "weights match single-process training" in out, out
    assert "rank 2: killed by SIGKILL" in out, out
