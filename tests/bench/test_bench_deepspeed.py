"""`tcoll bench --compare deepspeed`: what can be tested without DeepSpeed.

DeepSpeed's shared-memory all_reduce sums float32, bfloat16 and float16 and
silently returns anything else unreduced, so the bench must leave those
calls out, check the calls it times, and never show a wrong result as a
time. None of these tests imports DeepSpeed (it is an optional extra).
"""

from __future__ import annotations

import importlib.util
import os
import sys
from typing import Any

import numpy as np
import pytest

from tcoll.bench import compare
from tcoll.bench.collectives import CASES, Buffers, Params, Pattern, fill, layout, make_buffers, resolve_dtype
from tcoll.bench.deepspeed_worker import DeepSpeedBackend, refusal, shm_segment, unreduced
from tcoll.bench.report import aggregate, format_table
from tcoll.bench.plan import BenchConfig, make_plan, measurements
from tcoll.cli import main as tcoll_main


def _cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = tcoll_main(["bench", *argv])
    out, err = capsys.readouterr()
    return code, out, err


_SMALL = ["-n", "2", "-b", "64", "-e", "64", "--repeats", "1", "--iters", "2", "--no-floor"]


@pytest.mark.timeout(60)
def test_deepspeed_not_installed_is_skipped_and_the_rest_runs(monkeypatch: pytest.MonkeyPatch,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setitem(sys.modules, "deepspeed", None)  # find_spec says: not installed
    assert compare.missing("deepspeed") == "deepspeed is not installed (pip install tcoll[deepspeed])"
    code, out, err = _cli(["all_reduce", *_SMALL, "--compare", "deepspeed"], capsys)
    assert code == 0, err
    assert "# compare: deepspeed skipped: deepspeed is not installed (pip install tcoll[deepspeed])" in err
    header = out.splitlines()[0]
    assert "busbw (GB/s)" in header and "deepspeed" not in header
    assert len(out.splitlines()) == 2  # tcoll's line for 64 B


def test_compare_deepspeed_is_a_known_target() -> None:
    assert "deepspeed" in compare.TARGETS
    assert compare.versions(["deepspeed"]).keys() == {"tcoll", "deepspeed"}


def test_refusal_names_what_deepspeed_does_not_reduce() -> None:
    for dtype in ("float32", "bfloat16", "float16"):
        assert refusal("all_reduce", dtype, "sum") is None
        assert refusal("all_reduce", dtype, "sum", level=2) is None
    assert refusal("all_reduce", "float32", "sum", level=1) is None
    assert "ISA" in refusal("all_reduce", "bfloat16", "sum", level=1)
    assert "ISA" in refusal("all_reduce", "float32", "sum", level=0)
    assert "returns int32 unreduced" in refusal("all_reduce", "int32", "sum")
    assert "returns float64 unreduced" in refusal("all_reduce", "float64", "sum")
    assert "sums only" in refusal("all_reduce", "float32", "max")
    assert "all_reduce only, not broadcast" in refusal("broadcast", "float32", "sum")


def test_deepspeed_jobs_are_float_sum_all_reduces_always_checked() -> None:
    config = BenchConfig(cases=["all_reduce", "broadcast", "reduce"], n=2, sizes=[64, 4096], compare=["deepspeed"])
    plan = make_plan(config, "deepspeed")
    assert [job["case"] for job in plan["jobs"]] == ["all_reduce"]
    assert plan["check"] is True and make_plan(config, "tcoll")["check"] is False
    assert [nbytes for nbytes, _ in measurements(plan)] == [64, 4096]
    assert compare.limits("deepspeed", config.cases, "float32", "sum") == (
        ["all_reduce"], "broadcast, reduce left out: DeepSpeed's shared-memory op has all_reduce only, not broadcast")
    assert compare.limits("deepspeed", ["all_reduce"], "int8", "sum")[0] == []
    assert compare.limits("mpi", config.cases, "int8", "max") == (config.cases, None)


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("argv", "why"), [
    (["all_reduce", "-d", "int32"], "returns int32 unreduced"),
    (["all_reduce", "-o", "max"], "sums only (it ignores the op), not max"),
    (["broadcast"], "all_reduce only, not broadcast"),
])
def test_cases_deepspeed_cannot_reduce_are_skipped_with_a_note(monkeypatch: pytest.MonkeyPatch,
                                                                capsys: pytest.CaptureFixture[str],
                                                                argv: list[str], why: str) -> None:
    monkeypatch.setattr(compare, "missing", lambda target: None)  # as if installed: it must not start anyway
    monkeypatch.setattr(compare, "run_deepspeed", lambda *a: pytest.fail("deepspeed was started"))
    code, out, err = _cli([*argv, *_SMALL, "--compare", "deepspeed"], capsys)
    assert code == 0, err
    note = next(line for line in err.splitlines() if line.startswith("# compare: deepspeed"))
    assert note.startswith("# compare: deepspeed skipped: ") and why in note
    assert "deepspeed" not in out


def _filled(dtype: str, n: int, rank: int, count: int) -> tuple[Any, Buffers, Params]:
    case = CASES["all_reduce"]
    p = Params(n, rank, 0, resolve_dtype(dtype), "sum")
    lay = layout(case, count * p.dtype.itemsize, n, p.dtype.itemsize)
    bufs = make_buffers(case, lay, p, lambda shape, dt: np.empty(shape, dt))
    fill(bufs, Pattern(p.dtype, "sum", n), rank)
    return case, bufs, p


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_unreduced_counts_a_silent_fallback(dtype: str) -> None:
    case, bufs, p = _filled(dtype, 3, 1, 1000)
    assert unreduced(case, bufs.inp, p) == 1000  # left as it was: every element wrong
    bufs.inp[:] = Pattern(p.dtype, "sum", 3).reduced(0, 1000)
    assert unreduced(case, bufs.inp, p) == 0
    bufs.inp[7] = 0
    assert unreduced(case, bufs.inp, p) == 1


def _backend(call: Any, size: int = 2) -> DeepSpeedBackend:
    """A DeepSpeedBackend on one rank of `size`, its op `call`, without DeepSpeed or a process group."""
    backend = DeepSpeedBackend.__new__(DeepSpeedBackend)
    backend.rank, backend.size, backend.level, backend.local_size = 0, size, 2, str(size)
    backend.shm_op, backend.call = object(), call
    backend.sum_all = lambda value: value  # type: ignore[method-assign]  # one rank's count stands for all
    return backend


@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="needs torch (the op takes tensors)")
def test_bind_refuses_a_call_that_did_not_reduce() -> None:
    case, bufs, p = _filled("float32", 2, 0, 64)
    with pytest.raises(RuntimeError, match="left 64 elements .* unreduced"):
        _backend(lambda tensor: tensor).bind(case, bufs, p)  # DeepSpeed's silent fallback: data unchanged

    def sums(tensor: Any) -> Any:
        tensor.copy_(tensor * 3)  # rank 0 holds i+1, rank 1 2(i+1): the sum is 3(i+1)
        return tensor

    case, bufs, p = _filled("float32", 2, 0, 64)
    call = _backend(sums).bind(case, bufs, p)
    assert callable(call) and bufs.inp[5] == 3 * 6
    with pytest.raises(NotImplementedError, match="returns int32 unreduced"):
        _backend(sums).bind(*_filled("int32", 2, 0, 64))
    with pytest.raises(NotImplementedError, match="LOCAL_SIZE"):
        backend = _backend(sums)
        backend.local_size = None
        backend.bind(*_filled("float32", 2, 0, 64))
    with pytest.raises(NotImplementedError, match="all_reduce only"):
        _, bufs, p = _filled("float32", 2, 0, 64)
        _backend(sums).bind(CASES["broadcast"], bufs, p)


def test_a_wrong_compare_result_shows_as_wrong_not_as_a_time() -> None:
    base = {"case": "all_reduce", "count": 256, "dtype": "float32", "op": "sum", "n": 2, "buffers": "plain",
            "nbytes": 1024, "error": None, "repeat": 0}
    results = aggregate([dict(base, impl="tcoll", algorithm="auto", time=10e-6, wrong=0),
                         dict(base, impl="deepspeed", algorithm="deepspeed", time=1e-6, wrong=5),
                         dict(base, impl="mpi", algorithm="mpi", time=20e-6, wrong=0)])
    lines = format_table(results, "all_reduce").splitlines()
    assert "deepspeed (us)  deepspeed busbw  tcoll/deepspeed" in lines[0]
    assert lines[1].split()[-6:] == ["WRONG", "-", "-", "20.0", "0.051", "2.00"]


def test_shm_segments_are_named_as_deepspeed_names_them() -> None:
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1234"}
    assert shm_segment(3, env) == f"/dev/shm/deepspeed_allreduce_buffer_{os.getuid()}_127.0.0.1_1234_3"
