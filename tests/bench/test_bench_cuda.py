"""`tcoll bench --device cuda` and `--compare nccl`: what is refused, the copies, and (on a GPU) the real runs.

Without a GPU: the option checks (each a one-line usage error before any rank
starts), nccl left out where ranks outnumber GPUs, and the host <-> tensor
copies of the CUDA placement run on CPU tensors under every collective's
check. On a GPU (scripts/gpu_check.sh): tcoll on CUDA tensors with #wrong 0,
and NCCL's rows beside it at one rank.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import tcoll
from tcoll.bench import BenchError
from tcoll.bench import cli as bench_cli
from tcoll.bench import compare
from tcoll.bench.collectives import CASES, Buffers
from tcoll.bench.plan import BenchConfig, make_plan
from tcoll.bench.tcoll_backend import tcoll_worker
from tcoll.cli import main as tcoll_main

ROOT = Path(__file__).resolve().parents[2]
_TORCH = importlib.util.find_spec("torch") is not None


def _cuda() -> bool:
    if not _TORCH:
        return False
    import torch

    return bool(torch.cuda.is_available())


def _cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    """Run `tcoll bench ...` in this process: (exit code, stdout, stderr)."""
    code = tcoll_main(["bench", *argv])
    out, err = capsys.readouterr()
    return code, out, err


# -- refused before anything starts --------------------------------------------------------------------------


def test_device_cuda_without_torch_fails_at_once(monkeypatch: pytest.MonkeyPatch,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setitem(sys.modules, "torch", None)  # find_spec says: not installed
    code, out, err = _cli(["all_reduce", "-b", "8", "-e", "8", "--device", "cuda"], capsys)
    assert code == 2 and not out
    assert err == "tcoll bench: --device cuda needs torch with CUDA, and torch is not installed\n"


@pytest.mark.skipif(not _TORCH, reason="needs torch")
def test_device_cuda_without_a_gpu_fails_at_once(monkeypatch: pytest.MonkeyPatch,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # as on a machine without a GPU
    monkeypatch.setattr(bench_cli, "run_bench", _no_ranks)
    code, out, err = _cli(["all_reduce", "-b", "8", "-e", "8", "--device", "cuda"], capsys)
    assert code == 2 and not out
    assert len(err.splitlines()) == 1
    assert err.startswith("tcoll bench: --device cuda needs a CUDA GPU, and torch ") and err.endswith("sees none\n")


def _no_ranks(*args: Any, **kwargs: Any) -> Any:
    raise AssertionError("a refused run started its ranks")


@pytest.mark.parametrize("argv, message", [
    (["--compare", "nccl"], "--compare nccl needs --device cuda"),
    (["--compare", "gloo,nccl", "--device", "cpu"], "--compare nccl needs --device cuda"),
    (["--device", "cuda", "--buffers", "shm"], "--buffers shm is for --device cpu"),
    (["--device", "cuda", "--buffers", "both"], "--buffers both is for --device cpu"),
    (["--device", "cuda", "--persistent"], "--persistent is for --device cpu"),
    (["--device", "cuda", "--compare", "nccl,gloo"], "--compare gloo times CPU buffers"),
])
def test_options_that_do_not_go_with_the_device_are_refused(argv: list[str], message: str,
                                                              monkeypatch: pytest.MonkeyPatch,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(bench_cli, "run_bench", _no_ranks)
    code, out, err = _cli(["all_reduce", "-b", "8", "-e", "8", *argv], capsys)
    assert code == 2 and not out
    assert err.startswith(f"tcoll bench: {message}") and len(err.splitlines()) == 1, err


def test_nccl_is_left_out_where_ranks_share_a_gpu(monkeypatch: pytest.MonkeyPatch,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """As on the one-GPU machine: 2 ranks leave nccl out (saying why), 1 rank keeps it; the header names the GPU."""
    configs: list[BenchConfig] = []

    def stop(config: BenchConfig, progress: Any = None) -> Any:
        configs.append(config)
        raise BenchError("stopped before the ranks")

    monkeypatch.setattr(bench_cli, "cuda_problem", lambda: None)
    monkeypatch.setattr(bench_cli, "gpu_count", lambda: 1)
    monkeypatch.setattr(bench_cli, "describe_cuda", lambda: "1 GPU (Some GPU); torch 9, CUDA 9, NCCL 9")
    monkeypatch.setattr(compare, "missing", lambda target: None)
    monkeypatch.setattr(bench_cli, "run_bench", stop)
    code, _, err = _cli(["all_reduce", "-n", "2", "-b", "8", "-e", "8", "--device", "cuda", "--compare", "nccl"],
                        capsys)
    assert code == 1 and configs[-1].compare == []
    assert "# compare: nccl skipped: 2 ranks share 1 GPU(s); NCCL needs one GPU per rank\n" in err
    assert "# device: cuda, 1 GPU (Some GPU); torch 9, CUDA 9, NCCL 9\n" in err
    assert "no floor or copy columns" in err and "torch.cuda.synchronize()" in err
    assert (configs[-1].device, configs[-1].floor, configs[-1].copy) == ("cuda", False, False)
    code, _, err = _cli(["all_reduce", "-n", "1", "-b", "8", "-e", "8", "--device", "cuda", "--compare", "nccl"],
                        capsys)
    assert code == 1 and configs[-1].compare == ["nccl"] and "nccl skipped" not in err


# -- the copies of the CUDA placement, on CPU tensors ------------------------------------------------------


def _on_tensors(comm: Any, plan: dict[str, Any], skip_pull: bool) -> Any:
    import torch

    from tcoll.bench.device import TensorBuffers

    class NoPull(TensorBuffers):
        def pull(self, placed: Buffers, host: Buffers) -> None:
            pass  # the result never reaches the host buffers the check reads

    placement = (NoPull if skip_pull else TensorBuffers)(torch, torch.device("cpu"))
    return tcoll_worker(comm, plan, placement)


@pytest.mark.timeout(120)
@pytest.mark.skipif(not _TORCH, reason="needs torch")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int64"])
def test_tensor_placement_checks_every_collective_clean(dtype: str) -> None:
    """The sweep fills host buffers, copies them into tensors, calls on the tensors, and checks the copy back."""
    config = BenchConfig(cases=list(CASES), n=3, root=2, sizes=[64, 5000], repeats=1, iters=2, warmup=1,
                         check=True, device="cuda", dtype=dtype)
    plan = make_plan(config, "tcoll")
    assert not plan["floor"] and not plan["copy"]
    rows = tcoll.spawn(_on_tensors, 3, (plan, False), threads=True, timeout=100)[0]["rows"]
    assert {row["case"] for row in rows} == set(CASES)
    for row in rows:
        assert row["error"] is None and row["time"] > 0, row
        assert row["wrong"] == (None if row["case"] == "barrier" else 0), row


@pytest.mark.timeout(60)
@pytest.mark.skipif(not _TORCH, reason="needs torch")
def test_a_result_not_copied_back_is_counted_as_wrong() -> None:
    config = BenchConfig(cases=["all_reduce"], n=2, sizes=[64], repeats=1, iters=2, warmup=1, check=True,
                         device="cuda")
    rows = tcoll.spawn(_on_tensors, 2, (make_plan(config, "tcoll"), True), threads=True, timeout=50)[0]["rows"]
    assert rows[0]["wrong"] == 2 * (64 // 4)  # every element of both ranks, summed


# -- on a GPU ------------------------------------------------------------------------------------------------


def _bench(*argv: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]))
    return subprocess.run([sys.executable, "-m", "tcoll", "bench", "all_reduce", *argv], env=env,
                          capture_output=True, text=True, timeout=200, check=False)


def _column(stdout: str, name: str) -> list[str]:
    header, *lines = stdout.strip().splitlines()
    names = [cell.strip() for cell in header.split("  ") if cell.strip()]
    index = names.index(name)
    return [line.split()[index] for line in lines]


@pytest.mark.timeout(420)
@pytest.mark.skipif(not _cuda(), reason="needs a CUDA device")
def test_cuda_tensors_check_clean_and_nccl_runs_beside_at_one_rank() -> None:
    result = _bench("-n", "2", "-b", "8", "-e", "1M", "--device", "cuda", "--check", "--repeats", "1",
                    "--iters", "20")
    assert result.returncode == 0, result.stderr
    assert "# device: cuda, " in result.stderr and "copy" not in result.stdout
    wrong = _column(result.stdout, "#wrong")
    assert len(wrong) == 10 and set(wrong) == {"0"}, result.stdout  # 8 B .. 512 KiB in steps of 4, and 1 MiB
    assert all(float(t) > 0 for t in _column(result.stdout, "time (us)"))

    result = _bench("-n", "1", "-b", "8", "-e", "1M", "--device", "cuda", "--check", "--repeats", "1",
                    "--iters", "20", "--compare", "nccl")
    assert result.returncode == 0, result.stderr
    assert "nccl skipped" not in result.stderr and "nccl failed" not in result.stderr, result.stderr
    assert set(_column(result.stdout, "#wrong")) == {"0"}, result.stdout
    assert all(float(t) > 0 for t in _column(result.stdout, "nccl (us)")), result.stdout  # not "-" nor WRONG
