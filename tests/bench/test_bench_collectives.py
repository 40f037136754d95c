"""`tcoll bench <collective>`: correct results (#wrong), the formulas, the formats, compare targets, load.

The --check runs are the project's proof that the bench measures correct
collectives: every collective, every tcoll algorithm, 2 and 3 rank processes,
sizes that do and do not divide by the ranks. A deliberately broken
collective shows that #wrong is not a constant 0. No timing is asserted.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import tcoll
from tcoll.bench.collectives import (
    CASES,
    Buffers,
    Params,
    Pattern,
    count_wrong,
    fill,
    layout,
    make_buffers,
    resolve_dtype,
)
from tcoll.bench.report import (
    Result,
    aggregate,
    format_table,
    format_tables,
    plot,
    write_json,
)
from tcoll.bench.load import LOAD_MARKER, LoadGenerator
from tcoll.bench.plan import BenchConfig, make_plan, measurements
from tcoll.bench.runner import run_bench
from tcoll.bench.tcoll_backend import tcoll_worker
from tcoll.cli import main as tcoll_main

ROOT = Path(__file__).resolve().parents[2]


def _tcoll_results(outcome: dict[str, Any]) -> list[Result]:
    return [r for r in aggregate(outcome["samples"]) if r.impl == "tcoll"]


# -- formulas -----------------------------------------------------------------------------------


def test_busbw_factors_follow_nccl_tests() -> None:
    n = 4
    factors = {name: case.busbw_factor(n) for name, case in CASES.items()}
    assert factors == {"all_reduce": 1.5, "reduce": 1.0, "broadcast": 1.0, "all_gather": 0.75, "gather": 0.75,
                       "scatter": 0.75, "reduce_scatter": 0.75, "all_to_all": 0.75, "barrier": 1.0}
    r = Result("all_reduce", "tcoll", "auto", "plain", 1 << 20, 1 << 18, "float32", "sum", n, [1e-3, 2e-3, 4e-3])
    assert r.time == 2e-3 and r.min_time == 1e-3
    assert r.algbw == pytest.approx((1 << 20) / 2e-3 / 1e9)
    assert r.busbw == pytest.approx((1 << 20) / 2e-3 / 1e9 * 1.5)


def test_sizes_are_the_whole_buffer_rounded_down() -> None:
    f32 = 4
    assert layout(CASES["all_reduce"], 10, 3, f32) == layout(CASES["all_reduce"], 8, 3, f32)
    assert layout(CASES["all_reduce"], 10, 3, f32).nbytes == 8
    gathered = layout(CASES["all_gather"], 100, 3, f32)  # 25 elements -> 24: 8 per rank
    assert (gathered.count, gathered.block, gathered.nbytes) == (24, 8, 96)
    assert layout(CASES["all_to_all"], 64, 2, f32).block == 8
    assert layout(CASES["barrier"], 1 << 20, 2, f32).nbytes == 0
    p = Params(3, 0, 0, np.dtype(np.float32), "sum")
    assert CASES["reduce_scatter"].shapes(gathered, p) == ((24,), (8,))
    assert CASES["gather"].shapes(gathered, dataclasses.replace(p, rank=1)) == ((8,), None)


def test_measurements_skip_empty_sizes_and_time_a_barrier_once() -> None:
    config = BenchConfig(cases=["all_gather", "barrier"], n=3, sizes=[8, 64, 512])
    got = [(nbytes, job["case"]) for nbytes, job in measurements(make_plan(config, "tcoll"))]
    assert got == [(8, "barrier"), (64, "all_gather"), (512, "all_gather")]  # 8 B: 2 floats, 0 of 3 blocks


def test_pattern_sums_stay_exact_in_narrow_types() -> None:
    for dtype in ("float16", "bfloat16", "int8", "uint8"):
        pattern = Pattern(resolve_dtype(dtype), "sum", 8)
        exact = sum(pattern.values(r, 0, 500).astype(np.float64) for r in range(8))
        assert np.array_equal(pattern.reduced(0, 500).astype(np.float64), exact), dtype


# -- #wrong is counted ----------------------------------------------------------------------------


def test_count_wrong_counts_each_bad_element() -> None:
    case = CASES["all_to_all"]
    dtype = np.dtype(np.int32)
    lay = layout(case, 3 * 3 * 5 * 4, 3, dtype.itemsize)
    p = Params(3, 1, 0, dtype, "sum")
    pattern = Pattern(dtype, "sum", 3)
    bufs = make_buffers(case, lay, p, lambda shape, dt: np.empty(shape, dt))
    fill(bufs, pattern, p.rank)
    assert count_wrong(case, bufs, pattern, lay, p) == bufs.out.size  # nothing arrived yet
    for i in range(3):  # what rank i sends rank 1
        bufs.out[i] = pattern.values(i, lay.block, 2 * lay.block)
    assert count_wrong(case, bufs, pattern, lay, p) == 0
    bufs.out[2, :4] = 0
    assert count_wrong(case, bufs, pattern, lay, p) == 4


def _broken_all_reduce(comm: Any, bufs: Buffers, p: Params, op: str) -> Any:
    def call() -> None:
        comm.all_reduce(bufs.inp, op)
        if comm.rank == 1:
            bufs.inp[:3] += 1  # three wrong elements on one rank

    return call


def _silent_all_gather(comm: Any, bufs: Buffers, p: Params, op: str) -> Any:
    def call() -> None:
        bufs.out[p.rank] = bufs.inp  # keeps its own block, never receives the others

    return call


@pytest.mark.timeout(60)
def test_a_wrong_collective_is_counted_as_wrong(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(CASES, "broken_all_reduce", dataclasses.replace(
        CASES["all_reduce"], name="broken_all_reduce", tcoll=_broken_all_reduce))
    monkeypatch.setitem(CASES, "silent_all_gather", dataclasses.replace(
        CASES["all_gather"], name="silent_all_gather", tcoll=_silent_all_gather))
    config = BenchConfig(cases=["broken_all_reduce", "silent_all_gather"], n=3, sizes=[48, 4800], iters=2,
                         warmup=1, check=True)
    rows = tcoll.spawn(tcoll_worker, 3, (make_plan(config, "tcoll"),), threads=True, timeout=50)[0]["rows"]
    wrong = {(row["case"], row["nbytes"]): row["wrong"] for row in rows}
    assert wrong == {("broken_all_reduce", 48): 3, ("broken_all_reduce", 4800): 3,
                     ("silent_all_gather", 48): 3 * 2 * 4, ("silent_all_gather", 4800): 3 * 2 * 400}


# -- the bench measures correct collectives ---------------------------------------------------------


@pytest.mark.timeout(90)
@pytest.mark.parametrize("n", [2, 3])
def test_check_every_collective_and_algorithm_reports_no_wrong_element(n: int) -> None:
    buffers = ["plain", "shm"] if hasattr(tcoll.Communicator, "empty") else ["plain"]
    config = BenchConfig(cases=list(CASES), n=n, sizes=[8, 100, 4096, 65540], algorithm="all", buffers=buffers,
                         repeats=1, iters=2, warmup=1, check=True, root=n - 1, timeout=80)
    results = _tcoll_results(run_bench(config))
    assert {r.case for r in results} == set(CASES)
    for r in results:
        where = f"{r.case} {r.variant} at {r.nbytes} B"
        if r.error is not None:
            assert r.algorithm != "auto" and r.error.startswith("ValueError"), where + ": " + r.error
            continue
        assert r.time is not None and r.time > 0, where
        assert r.wrong == (None if r.case == "barrier" else 0), where
    assert not any(r.error for r in results if r.algorithm == "auto")


@pytest.mark.timeout(90)
def test_persistent_plans_check_clean_and_the_floor_is_timed() -> None:
    config = BenchConfig(cases=list(CASES), n=3, root=1, sizes=[8, 4096, 70000], repeats=1, iters=3, warmup=1,
                         check=True, persistent=True, timeout=80)
    results = aggregate(run_bench(config)["samples"])
    plans = [r for r in results if r.impl == "tcoll" and r.form == "persistent"]
    assert {r.case for r in plans} == set(CASES)
    for r in plans:
        assert r.variant.endswith("/plan") and r.error is None and r.time, (r.case, r.error)
        assert r.wrong == (None if r.case == "barrier" else 0), (r.case, r.nbytes)
    floors = [r for r in results if r.impl == "floor"]
    assert [r.nbytes for r in floors] == [8, 4096, 70000] and all(r.time > 0 for r in floors)
    table = format_table(results, "all_reduce").splitlines()
    assert "floor (us)" in table[0] and "tcoll/floor" in table[0] and any("auto/plan" in line for line in table)


@pytest.mark.timeout(90)
def test_the_copy_rate_is_measured_at_each_all_reduce_size_and_busbw_set_against_it() -> None:
    config = BenchConfig(cases=["all_reduce", "broadcast"], n=2, sizes=[6, 4096, 70001], repeats=2, iters=3,
                         warmup=1, floor=False, timeout=80)
    results = aggregate(run_bench(config)["samples"])
    copies = {r.nbytes: r for r in results if r.impl == "copy"}
    assert sorted(copies) == [4, 4096, 70000]  # the all_reduce rows' sizes (whole float32 elements)
    for r in copies.values():
        assert r.case == "all_reduce" and len(r.times) == 2 and r.algbw > 0 and r.busbw is None, r
    assert all(c.algbw > copies[4].algbw for n, c in copies.items() if n > 4)  # NumPy's call cost dominates 4 B
    header, *lines = format_table(results, "all_reduce").splitlines()
    assert header.split()[11:15] == ["#wrong", "copy", "GB/s", "busbw/copy"]
    assert "copy (us)" not in header and "tcoll/copy" not in header  # not a compare target
    tcoll_rows = {r.nbytes: r for r in results if r.impl == "tcoll" and r.case == "all_reduce"}
    for line in lines:
        cells = line.split()
        nbytes, rate, fraction = int(cells[0]), float(cells[8]), float(cells[9])
        want = tcoll_rows[nbytes].busbw / copies[nbytes].algbw
        assert rate == pytest.approx(copies[nbytes].algbw, abs=1e-3) and rate > 0
        assert fraction == pytest.approx(want, abs=0.006) and want > 0
    assert "copy GB/s" not in format_table(results, "broadcast")
    plan = make_plan(dataclasses.replace(config, copy=False), "tcoll")
    assert plan["copy"] is False and make_plan(config, "tcoll")["copy"] is True
    assert make_plan(dataclasses.replace(config, cases=["broadcast"]), "tcoll")["copy"] is False
    assert make_plan(dataclasses.replace(config, compare=["gloo"]), "gloo")["copy"] is False


def test_the_copy_columns_format() -> None:
    copy = {"case": "all_reduce", "count": 256, "dtype": "float32", "op": "sum", "n": 2, "buffers": "plain",
            "nbytes": 1024, "wrong": None, "error": None, "impl": "copy", "algorithm": "copy", "time": 2e-6}
    results = aggregate([*_samples(), dict(copy, repeat=0), dict(copy, time=4e-6, repeat=1),
                         dict(copy, time=1e-6, repeat=2)])
    text = format_table(results, "all_reduce", markdown=True).splitlines()
    assert text[0] == ("| size (B) | count | dtype | op | tcoll | time (us) | algbw (GB/s) | busbw (GB/s) | #wrong | "
                       "copy GB/s | busbw/copy | mpi (us) | mpi busbw | tcoll/mpi |")
    # the copy's median time 2 us: 0.512 GB/s; tcoll's busbw 1024 B / 20 us = 0.0512 GB/s: a tenth of it
    assert text[2] == ("| 1024 | 256 | float32 | sum | auto | 20.0 | 0.051 | 0.051 | 0 | 0.512 | 0.10 | 40.0 | "
                       "0.026 | 2.00 |")
    assert text[3].split(" | ")[8:11] == ["-", "0.512", "-"]  # ring could not run: no fraction
    assert format_table([r for r in results if r.impl != "copy"], "all_reduce").count("copy") == 0


@pytest.mark.timeout(60)
def test_dtypes_and_ops_check_clean() -> None:
    for dtype, op in (("int8", "prod"), ("bfloat16", "max"), ("float64", "min")):
        config = BenchConfig(cases=["all_reduce", "reduce_scatter", "reduce"], n=3, sizes=[96, 3000],
                             dtype=dtype, op=op, repeats=1, iters=2, warmup=1, check=True)
        results = _tcoll_results(run_bench(config))
        assert results and all(r.wrong == 0 for r in results), (dtype, op)


# -- compare targets ---------------------------------------------------------------------------------


def _cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    """Run `tcoll bench ...` in this process: (exit code, stdout, stderr)."""
    code = tcoll_main(["bench", *argv])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.timeout(60)
def test_no_copy_leaves_the_copy_columns_out(capsys: pytest.CaptureFixture[str]) -> None:
    small = ["all_reduce", "-n", "2", "-b", "64", "-e", "64", "--repeats", "1", "--iters", "2", "--no-floor"]
    code, out, err = _cli(small, capsys)
    assert code == 0, err
    header, line = out.splitlines()
    assert header.split()[-3:] == ["copy", "GB/s", "busbw/copy"] and float(line.split()[-2]) > 0
    code, out, err = _cli([*small, "--no-copy"], capsys)
    assert code == 0 and "copy" not in out, (err, out)


@pytest.mark.timeout(60)
def test_a_compare_target_not_installed_is_skipped(monkeypatch: pytest.MonkeyPatch,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setitem(sys.modules, "mpi4py", None)  # find_spec says: not installed
    monkeypatch.setitem(sys.modules, "torch", None)
    code, out, err = _cli(["all_reduce", "-n", "2", "-b", "64", "-e", "64", "--repeats", "1", "--iters", "2",
                           "--compare", "gloo,mpi"], capsys)
    assert code == 0, err
    assert "# compare: gloo skipped: torch is not installed (pip install tcoll[compare])" in err
    assert "# compare: mpi skipped: mpi4py is not installed (pip install tcoll[compare])" in err
    header = out.splitlines()[0]
    assert "busbw (GB/s)" in header and "gloo" not in header and "mpi" not in header


def _have(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


@pytest.mark.timeout(120)
@pytest.mark.skipif(not (_have("torch") and _have("mpi4py")), reason="needs torch and mpi4py")
def test_compare_gloo_and_mpi_run_the_same_checked_collectives() -> None:
    config = BenchConfig(cases=list(CASES), n=3, root=1, sizes=[64, 8192], compare=["gloo", "mpi"], repeats=1,
                         iters=3, warmup=1, check=True, timeout=100)
    outcome = run_bench(config)
    results = aggregate(outcome["samples"])
    # the floor and the copy rate: all_reduce, in tcoll's run
    assert {r.impl for r in results} == {"tcoll", "gloo", "mpi", "floor", "copy"}
    for r in results:
        assert r.error is None and r.time, (r.impl, r.case, r.error)
        assert r.wrong == (None if r.case == "barrier" or r.impl in ("floor", "copy") else 0), \
            (r.impl, r.case, r.nbytes)
    assert "MPICH" in outcome["info"]["mpi"]["library"]
    line = format_table(results, "all_reduce").splitlines()[1].split()
    assert len(line) == 8 + 2 + 3 * 3 and all(cell != "-" for cell in line[:10])


@pytest.mark.timeout(120)
@pytest.mark.skipif(not _have("mpi4py"), reason="needs mpi4py")
def test_an_mpiexec_that_starts_singletons_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Another MPI's mpiexec starts n jobs of one rank each: their figures would be a one-rank call's, so the
    compare target fails and is left out, saying why, instead of showing them."""
    fake = tmp_path / "mpiexec"
    fake.write_text('#!/bin/sh\nn=$2; shift 2\nfor i in $(seq "$n"); do "$@" & done\nwait\n')
    fake.chmod(0o755)
    code, out, err = _cli(["all_reduce", "-n", "2", "-b", "64", "-e", "64", "--repeats", "1", "--iters", "2",
                           "--compare", "mpi", "--mpiexec", str(fake)], capsys)
    assert code == 0, err
    assert "# compare: mpi failed and is left out" in err and "sees 1 rank(s), not the 2 asked for" in err
    assert "mpi" not in out.splitlines()[0]


# -- formats -------------------------------------------------------------------------------------------


def _samples() -> list[dict[str, Any]]:
    base = {"case": "all_reduce", "count": 256, "dtype": "float32", "op": "sum", "n": 2, "buffers": "plain",
            "nbytes": 1024, "wrong": 0, "error": None}
    return [dict(base, impl="tcoll", algorithm="auto", time=10e-6, repeat=0),
            dict(base, impl="tcoll", algorithm="auto", time=30e-6, repeat=1),
            dict(base, impl="tcoll", algorithm="auto", time=20e-6, repeat=2),
            dict(base, impl="mpi", algorithm="mpi", time=40e-6, wrong=None, repeat=0),
            dict(base, impl="tcoll", algorithm="ring", time=None, wrong=None, error="ValueError: no", repeat=0)]


def test_table_markdown_and_json_formats(tmp_path: Path) -> None:
    results = aggregate(_samples())
    text = format_table(results, "all_reduce").splitlines()
    assert text[0].split() == ["size", "(B)", "count", "dtype", "op", "tcoll", "time", "(us)", "algbw", "(GB/s)",
                               "busbw", "(GB/s)", "#wrong", "mpi", "(us)", "mpi", "busbw", "tcoll/mpi"]
    assert text[1].split() == ["1024", "256", "float32", "sum", "auto", "20.0", "0.051", "0.051", "0", "40.0",
                               "0.026", "2.00"]
    assert text[2].split() == ["1024", "256", "float32", "sum", "ring", "-", "-", "-", "-", "40.0", "0.026", "-"]
    markdown = format_tables(results, markdown=True).splitlines()
    assert markdown[0] == ("| size (B) | count | dtype | op | tcoll | time (us) | algbw (GB/s) | busbw (GB/s) | "
                           "#wrong | mpi (us) | mpi busbw | tcoll/mpi |")
    assert markdown[1] == "|" + "---|" * 12
    assert markdown[2] == "| 1024 | 256 | float32 | sum | auto | 20.0 | 0.051 | 0.051 | 0 | 40.0 | 0.026 | 2.00 |"
    path = tmp_path / "out.json"
    write_json(str(path), {"n": 2}, results, _samples())
    data = json.loads(path.read_text())
    auto = data["results"][0]
    assert (auto["times"], auto["time"], auto["min_time"]) == ([10e-6, 30e-6, 20e-6], 20e-6, 10e-6)
    assert auto["busbw"] == pytest.approx(1024 / 20e-6 / 1e9)
    assert data["results"][2]["error"] == "ValueError: no" and len(data["samples"]) == 5


def test_plot_needs_matplotlib(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
                               tmp_path: Path) -> None:
    if _have("matplotlib"):
        plot(aggregate(_samples()), str(tmp_path / "p.png"))
        assert (tmp_path / "p.png").stat().st_size > 0
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    code, _, err = _cli(["all_reduce", "--plot", str(tmp_path / "q.png")], capsys)
    assert code == 2 and "pip install tcoll[plot]" in err and not (tmp_path / "q.png").exists()


def test_usage_errors_are_clear(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = _cli(["all_reduce", "--algorithm", "nosuch"], capsys)
    assert code == 2 and "all_reduce has no algorithm 'nosuch'" in err
    code, _, err = _cli(["allreduce"], capsys)
    assert code == 2 and "unknown case" in err
    monkeypatch.delattr(tcoll.Communicator, "empty", raising=False)
    code, _, err = _cli(["all_reduce", "--buffers", "shm"], capsys)
    assert code == 2 and "--buffers shm needs Communicator.empty" in err


# -- the command and the load --------------------------------------------------------------------------


_TOKEN = "TCOLL_TEST_LOAD_TOKEN"  # in the environment of the load processes a test starts, and only theirs


def _load_pids(token: str) -> list[int]:
    """Processes running the bench's load loop that this test started (their environment carries `token`):
    other jobs on the machine may run loads of their own."""
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as handle:
                    if LOAD_MARKER.encode() not in handle.read().split(b"\0"):
                        continue
                with open(f"/proc/{entry}/environ", "rb") as handle:
                    if f"{_TOKEN}={token}".encode() in handle.read().split(b"\0"):
                        pids.append(int(entry))
            except OSError:
                pass
    return pids


@pytest.mark.alone  # (its busy processes would slow the tests beside it)
@pytest.mark.timeout(30)
def test_load_processes_run_and_are_stopped_even_on_error(monkeypatch: pytest.MonkeyPatch) -> None:
    token = os.urandom(8).hex()
    monkeypatch.setenv(_TOKEN, token)
    with pytest.raises(KeyboardInterrupt), LoadGenerator(2) as load:
        pids = [proc.pid for proc in load.procs]
        assert len(pids) == 2 and all(proc.poll() is None for proc in load.procs)
        assert sorted(pids) == sorted(_load_pids(token))
        raise KeyboardInterrupt
    assert _load_pids(token) == []
    assert all(not os.path.exists(f"/proc/{pid}") for pid in pids)


@pytest.mark.alone  # (its busy processes would slow the tests beside it)
@pytest.mark.timeout(60)
def test_cli_prints_header_markdown_and_json_with_load(tmp_path: Path) -> None:
    token = os.urandom(8).hex()
    env = dict(os.environ, **{_TOKEN: token}, PYTHONPATH=os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]))
    out_json = tmp_path / "r.json"
    result = subprocess.run([sys.executable, "-m", "tcoll", "bench", "broadcast,gather", "-n", "3", "-b", "64",
                             "-e", "4K", "-f", "64", "--repeats", "2", "--iters", "3", "--check", "--markdown",
                             "--load", "1", "--json", str(out_json)],
                            env=env, capture_output=True, text=True, timeout=55, check=False)
    assert result.returncode == 0, result.stderr
    for line in ("# machine: ", "# versions: tcoll ", "# ranks: 3, dtype float32", "# load: 1 busy processes"):
        assert line in result.stderr
    assert "measurements in" in result.stderr
    lines = result.stdout.strip().splitlines()
    assert lines[0] == "#### broadcast (3 ranks)"
    assert lines[1].startswith("| size (B) | count | dtype | op | time (us) |")
    assert [line.split(" | ")[0] for line in lines[3:5]] == ["| 64", "| 4096"]
    assert "#### gather (3 ranks)" in lines
    data = json.loads(out_json.read_text())
    assert data["header"]["load"] == 1 and len(data["samples"]) == 2 * 4
    assert all(r["wrong"] == 0 and len(r["times"]) == 2 for r in data["results"])
    assert _load_pids(token) == []
