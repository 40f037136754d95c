"""CUDA buffers on NCCL under tcoll's control plane (tcoll.comm.nccl).

Everywhere: which calls NCCL takes (plan), the fingerprint exchange that makes
a disagreement a MismatchError on every rank before anything is queued
(agree), and the choice of path (choose_path), on thread ranks.
On a GPU (scripts/gpu_check.sh; one GPU, so NCCL runs at world size 1): every
NCCL call against NumPy, on float32, bfloat16 and int64; the stream rule; a
timeout that aborts the NCCL communicator and names the call and rank; two
ranks on one GPU refused by name with TCOLL_GPU=nccl; a mismatch raised on
every rank by the exchange before NCCL is ever started.
"""

from __future__ import annotations

import numpy as np
import pytest

import tcoll
from tcoll.comm import nccl, staging
from tcoll.comm.nccl_lib import Nccl, NcclError

torch = pytest.importorskip("torch")


def _nccl_loads() -> bool:
    try:
        Nccl.load()
    except NcclError:
        return False
    return True


CUDA_NCCL = torch.cuda.is_available() and _nccl_loads()
needs_nccl = pytest.mark.skipif(not CUDA_NCCL, reason="needs a CUDA device and the NCCL library")


# -- everywhere ----------------------------------------------------------------------------------------


def _args(x, **more):
    return {"x": x, "op": "sum", "root": 0, "out": None, "algorithm": "auto", "async_op": False, **more}


def test_plan_takes_what_nccl_has() -> None:
    x = torch.zeros(4, 3)
    p = nccl.plan("all_reduce", _args(x), torch, 2)
    assert p is not None and p.words == [1, 0, 7, 12, 0, 12] and p.result is x
    assert nccl.plan("all_reduce", _args(x, op="avg"), torch, 2).words[1] == 4
    assert nccl.plan("reduce", _args(torch.zeros(2, dtype=torch.bfloat16), op="max", root=1), torch, 2).words == \
        [2, 2, 9, 2, 1, 2]
    gathered = nccl.plan("all_gather", _args(torch.zeros(3, dtype=torch.int64)), torch, 4)
    assert tuple(gathered.result.shape) == (4, 3) and gathered.words[2] == 4
    part = nccl.plan("reduce_scatter", _args(torch.zeros(4, 2)), torch, 2)
    assert tuple(part.result.shape) == (2, 2) and part.words[5] == 4
    for spelling in ("SUM", "Sum", tcoll.SUM):  # every spelling the CPU path takes is NCCL's sum too
        assert nccl.plan("all_reduce", _args(x, op=spelling), torch, 2).words[1] == 0
    out = torch.zeros(2, 3)
    assert nccl.plan("all_gather", _args(torch.zeros(3), out=out), torch, 2).result is out


_BASE = torch.zeros(6)


@pytest.mark.parametrize("name, change", [
    ("all_reduce", {"op": "band"}),                                    # bitwise: NCCL has none
    ("all_reduce", {"op": tcoll.Op(np.add, commutative=True)}),         # a user op
    ("all_reduce", {"x": torch.zeros(4, dtype=torch.int32), "op": "avg"}),  # avg of integers
    ("all_reduce", {"x": torch.zeros(4, dtype=torch.bool)}),           # a dtype NCCL lacks
    ("all_reduce", {"algorithm": "ring"}),                             # a named algorithm is tcoll's
    ("reduce_scatter", {"x": torch.zeros(3)}),                         # not size equal parts
    ("all_reduce", {"x": torch.zeros(4, 2).t()}),                      # strided: NCCL reads one span
    ("all_gather", {"out": torch.zeros(2, 3)}),                        # out of the wrong shape
    ("all_to_all", {"x": torch.zeros(4, 3)}),                          # not one part per rank (the CPU's rule)
    ("broadcast", {"root": 2}),                                        # a root out of range
    ("reduce_scatter", {"x": _BASE[:4], "out": _BASE[3:5]}),           # out overlaps x
    ("scan", {}),                                                       # not an NCCL call
])
def test_plan_leaves_the_rest_to_staging(name: str, change: dict) -> None:
    args = _args(torch.zeros(4))
    args.update(change)
    assert nccl.plan(name, args, torch, 2) is None


def _agree(comm: tcoll.Communicator, words_of: dict[int, list[int]]) -> str:
    try:
        nccl.agree(comm, words_of.get(comm.rank, words_of[0]), "all_reduce")
    except (tcoll.MismatchError, tcoll.PeerFailedError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return "agreed"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("size", [1, 3])
def test_agreeing_ranks_go_on(size: int) -> None:
    assert tcoll.spawn(_agree, size, ({0: [1, 0, 7, 8, 0, 8]},), threads=True, timeout=60) == ["agreed"] * size


@pytest.mark.timeout(60)
def test_a_disagreement_is_a_mismatch_on_every_rank_before_anything_is_queued() -> None:
    got = tcoll.spawn(_agree, 3, ({0: [1, 0, 7, 8, 0, 8], 2: [1, 2, 7, 8, 0, 8]},), threads=True, timeout=60)
    assert all(text.startswith("MismatchError") for text in got), got
    assert "rank 2 calls all_reduce(count=8, nccl dtype 7, op max" in got[0]


@pytest.mark.timeout(60)
def test_a_rank_whose_nccl_failed_fails_the_next_call_everywhere() -> None:
    got = tcoll.spawn(_agree, 2, ({0: [1, 0, 7, 8, 0, 8], 1: [nccl._BROKEN, 0, 0, 0, 0, 0]},), threads=True,
                      timeout=60)
    assert all(text.startswith("PeerFailedError") and "rank 1: its NCCL communicator failed" in text
               for text in got), got


def _choose(comm: tcoll.Communicator, gpus: list[str], setting: str) -> str:
    try:
        return nccl.choose_path(comm, torch, gpus[comm.rank], setting)
    except ValueError as exc:
        return f"ValueError: {exc}"


@pytest.mark.timeout(60)
def test_the_path_is_nccl_only_where_every_rank_has_its_own_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(nccl, "_gpu_identity", lambda torch, device: device)
    monkeypatch.setattr(Nccl, "load", classmethod(lambda cls: None))
    assert tcoll.spawn(_choose, 3, (["a", "b", "c"], "auto"), threads=True, timeout=60) == ["nccl"] * 3
    assert tcoll.spawn(_choose, 3, (["a", "b", "a"], "auto"), threads=True, timeout=60) == ["staging"] * 3
    refused = tcoll.spawn(_choose, 3, (["a", "b", "a"], "nccl"), threads=True, timeout=60)
    assert all("ranks [0, 2] share a GPU" in text for text in refused), refused


@pytest.mark.timeout(60)
def test_without_nccl_auto_stages_and_nccl_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    def missing(cls):
        raise NcclError("no NCCL library could be loaded")

    monkeypatch.setattr(nccl, "_gpu_identity", lambda torch, device: device)
    monkeypatch.setattr(Nccl, "load", classmethod(missing))
    assert tcoll.spawn(_choose, 2, (["a", "b"], "auto"), threads=True, timeout=60) == ["staging"] * 2
    refused = tcoll.spawn(_choose, 2, (["a", "b"], "nccl"), threads=True, timeout=60)
    assert all("NCCL cannot be loaded on rank(s) 0: no NCCL" in text for text in refused), refused


# -- on a GPU ------------------------------------------------------------------------------------------


def _dev(values: np.ndarray, dtype: str) -> torch.Tensor:
    return torch.tensor(values, dtype=getattr(torch, dtype), device="cuda")


def _host(t: torch.Tensor) -> np.ndarray:
    return t.detach().cpu().double().numpy() if t.dtype != torch.int64 else t.cpu().numpy()


def every_nccl_call(comm: tcoll.Communicator, dtype: str) -> list[str]:
    """Each NCCL call at world size 1 against NumPy; returns the calls NCCL ran (counted at the queue)."""
    ran: list[str] = []
    queue = nccl._queue
    nccl._queue = lambda lib, handle, p, stream, size: (ran.append(p.name), queue(lib, handle, p, stream, size))
    try:
        values = (np.arange(12) % 7 - 3).astype(np.float64)
        for op, want in (("sum", values), ("prod", values), ("max", values), ("min", values)):
            x = _dev(values, dtype)
            assert comm.all_reduce(x, op=op) is x
            np.testing.assert_array_equal(_host(x), want, err_msg=op)
        x = _dev(values, dtype)
        work = comm.all_reduce(x, async_op=True)
        assert work.wait(timeout=60) is x
        x = _dev(values, dtype)
        comm.reduce(x, root=0)
        comm.broadcast(x, root=0)
        np.testing.assert_array_equal(_host(x), values)
        np.testing.assert_array_equal(_host(comm.all_gather(_dev(values, dtype))), values[None])
        out = _dev(np.zeros((1, 12)), dtype)
        assert comm.all_gather(_dev(values, dtype), out=out) is out
        np.testing.assert_array_equal(_host(comm.reduce_scatter(_dev(values.reshape(3, 4), dtype))),
                                      values.reshape(3, 4))
        np.testing.assert_array_equal(_host(comm.all_to_all(_dev(values.reshape(1, 12), dtype))),
                                      values.reshape(1, 12))
        x = _dev(values, dtype)
        comm.scan(x)  # not an NCCL call: staged, beside the NCCL ones, on the same stream
        np.testing.assert_array_equal(_host(x), values)
    finally:
        nccl._queue = queue
    return ran


@needs_nccl
@pytest.mark.timeout(180)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int64"])
def test_every_nccl_call_at_world_size_1(dtype: str) -> None:
    (ran,) = tcoll.spawn(every_nccl_call, 1, (dtype,), env={"TCOLL_GPU": "nccl"}, timeout=150)
    assert ran == ["all_reduce"] * 5 + ["reduce", "broadcast", "all_gather", "all_gather", "reduce_scatter",
                                        "all_to_all"]


def behind_a_kernel(comm: tcoll.Communicator) -> bool:
    """NCCL's call is queued behind a kernel still writing its input; the work after it sees the result."""
    x = torch.zeros(1 << 20, device="cuda")
    torch.cuda._sleep(200_000_000)  # about 0.1 s of GPU time on the current stream before the fill
    x.fill_(3)
    comm.all_reduce(x, op="max")
    y = x * 2
    return bool((x == 3).all().item()) and bool((y == 6).all().item()) and comm in nccl._states


@needs_nccl
@pytest.mark.timeout(120)
def test_an_nccl_call_is_ordered_on_the_callers_stream() -> None:
    assert tcoll.spawn(behind_a_kernel, 1, env={"TCOLL_GPU": "nccl"}, timeout=100) == [True]


def times_out(comm: tcoll.Communicator) -> list[str]:
    """A call stuck behind 4 s of GPU work with a 1 s timeout: aborted, named, and raised by the next call."""
    x = torch.ones(8, device="cuda")
    comm.all_reduce(x)  # the NCCL communicator exists before the timed call
    torch.cuda.synchronize()
    torch.cuda._sleep(8_000_000_000)
    work = comm.all_reduce(x, async_op=True)
    seen = []
    try:
        work.wait()
    except tcoll.TimeoutError as exc:
        seen.append(str(exc))
    try:
        comm.all_reduce(x)
    except tcoll.TimeoutError as exc:
        seen.append(str(exc))
    return seen


@needs_nccl
@pytest.mark.timeout(120)
def test_a_stuck_nccl_call_is_aborted_and_named() -> None:
    # No spawn timeout: it would be the communicator's too; pytest's timeout guards the run.
    (seen,) = tcoll.spawn(times_out, 1, env={"TCOLL_GPU": "nccl", "TCOLL_TIMEOUT": "1"})
    assert len(seen) == 2 and all("all_reduce" in s and "rank 0" in s and "aborted" in s for s in seen), seen


def shared_gpu(comm: tcoll.Communicator) -> str:
    torch.cuda.set_device(0)
    try:
        comm.all_reduce(torch.ones(4, device="cuda"))
    except ValueError as exc:
        return str(exc)
    return "no error"


@needs_nccl
@pytest.mark.timeout(120)
def test_two_ranks_on_one_gpu_are_refused_nccl_by_name() -> None:
    got = tcoll.spawn(shared_gpu, 2, env={"TCOLL_GPU": "nccl"}, timeout=100)
    assert all("ranks [0, 1] share a GPU" in text for text in got), got


def forced_mismatch(comm: tcoll.Communicator, what: str) -> str:
    """The NCCL path taken as if each rank had its own GPU: the exchange raises before NCCL ever starts."""
    staging._paths[comm] = "nccl"
    n = 8 if what == "op" or comm.rank == 0 else 9
    op = "sum" if what == "size" or comm.rank == 0 else "max"
    try:
        comm.all_reduce(torch.ones(n, device="cuda"), op=op)
    except tcoll.MismatchError as exc:
        return type(exc).__name__ + ("" if comm not in nccl._states else " (but NCCL was started)")
    return "no error"


@needs_nccl
@pytest.mark.timeout(120)
@pytest.mark.parametrize("what", ["op", "size"])
def test_a_mismatch_on_the_nccl_path_raises_on_every_rank(what: str) -> None:
    assert tcoll.spawn(forced_mismatch, 2, (what,), env={"TCOLL_GPU": "nccl"}, timeout=100) == ["MismatchError"] * 2


def test_explain_says_what_runs_on_the_gpu() -> None:
    text = tcoll.explain("all_reduce", "64MiB", 4, gpu="nccl")
    assert "NCCL runs this all_reduce" in text and "all_reduce, 96 B per rank" in text
    assert "staged as NCCL has no such call" in tcoll.explain("scan", "1MiB", 2, gpu="nccl")
    assert "staged as the path is staging" in tcoll.explain("all_reduce", "1MiB", 2, gpu="staging")
    with pytest.raises(ValueError, match="gpu must be"):
        tcoll.explain("all_reduce", 8, 2, gpu="cuda")


@pytest.mark.timeout(60)
def test_ranks_whose_nccl_all_failed_do_not_agree_to_go_on() -> None:
    """Equal descriptions of failure still fail: agreement is for calls, not for every rank being broken."""
    got = tcoll.spawn(_agree, 2, ({0: [nccl._BROKEN, 0, 0, 0, 0, 0]},), threads=True, timeout=60)
    assert all(text.startswith("PeerFailedError") and "rank 0: its NCCL" in text for text in got), got


def _agree_twice(comm: tcoll.Communicator) -> list[str]:
    """A second call on the same communicator agrees too (the buffer is reused), then a third disagrees."""
    words = [1, 0, 7, 8, 0, 8]
    seen = [_agree(comm, {0: words}), _agree(comm, {0: words})]
    seen.append(_agree(comm, {0: words, 1: [1, 0, 7, 9, 0, 9]}))
    return seen


@pytest.mark.timeout(60)
def test_agreement_is_checked_afresh_at_every_call() -> None:
    for seen in tcoll.spawn(_agree_twice, 2, timeout=60):
        assert seen[:2] == ["agreed", "agreed"] and seen[2].startswith("MismatchError"), seen


def _stage_or_not(comm: tcoll.Communicator, staged_ranks: list[int]) -> bool:
    words = [nccl._STAGED, 0, 0, 0, 0, 0] if comm.rank in staged_ranks else [1, 0, 7, 8, 0, 8]
    return nccl.agree(comm, words, "all_reduce")


@pytest.mark.timeout(60)
def test_a_call_one_rank_cannot_take_on_nccl_is_staged_by_every_rank() -> None:
    """Where NCCL cannot take a call on one rank (a strided buffer, say), every rank stages it: one CPU call."""
    assert tcoll.spawn(_stage_or_not, 3, ([1],), threads=True, timeout=60) == [False] * 3
    assert tcoll.spawn(_stage_or_not, 3, ([0, 1, 2],), threads=True, timeout=60) == [False] * 3
    assert tcoll.spawn(_stage_or_not, 3, ([],), threads=True, timeout=60) == [True] * 3
