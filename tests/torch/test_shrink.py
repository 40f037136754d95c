"""A torch "tcoll" group survives a dead rank: a real SIGKILL, then revoke, shrink_group, and the new group's calls.

The ranks run under tcoll.spawn(keep_going=True), each with its own torch
default group (tests/helpers/torch_survivors.py); the spawn's SpawnError
carries the survivors' reports.
"""

from __future__ import annotations

import weakref
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("torch")

from helpers.procs import free_port, shm_segments  # noqa: E402
from helpers.torch_survivors import shrink_after_death  # noqa: E402

import tcoll  # noqa: E402


NAMED_WITHIN_S = 5.0  # every survivor gets a named error this soon after the death


def _run(size: int, *args: Any) -> tuple[list[Any], dict[int, str]]:
    try:
        results = tcoll.spawn(shrink_after_death, size, (free_port(), *args), timeout=60, keep_going=True,
                              env={"OMP_NUM_THREADS": "1"})
    except tcoll.SpawnError as exc:
        return exc.results, exc.failures
    raise AssertionError(f"no rank failed: {results}")


def _check(results: list[Any], failures: dict[int, str], victim: int) -> list[dict[str, Any]]:
    size = len(results)
    assert sorted(failures) == [victim] and "SIGKILL" in failures[victim], failures
    reports = [results[r] for r in range(size) if r != victim]
    survivors = [r for r in range(size) if r != victim]
    for new, report in enumerate(reports):
        assert report["after_s"] < NAMED_WITHIN_S, report
        assert report["failed"] == [victim], report
        assert (report["old_rank"], report["global_rank"]) == (survivors[new], survivors[new]), report
        assert (report["rank"], report["size"], report["ranks"]) == (new, size - 1, survivors), report
        assert report["backend"] == "tcoll" and report["default_revoked"], report
        assert report["agree"] == 0b010 and report["old_closed"], report
    run_id = reports[0]["run_id"]
    assert run_id and shm_segments(run_id) == [], shm_segments(run_id)
    return reports


@pytest.mark.usefixtures("no_leftovers")
@pytest.mark.timeout(60)
def test_survivors_of_an_all_reduce_shrink_and_go_on() -> None:
    """3 ranks; rank 1 dies before an all_reduce: ranks 0 and 2 get PeerLostError naming it, and become 0 and 1."""
    results, failures = _run(3, 1)
    for report in _check(results, failures, 1):
        assert report["error"] == "PeerLostError" and "rank 1" in report["text"], report


@pytest.mark.usefixtures("no_leftovers")
@pytest.mark.timeout(60)
def test_revoke_frees_a_rank_that_waits_on_a_live_one() -> None:
    """4 ranks; rank 0 (it also serves torch's store) dies; rank 1 waits in a receive from the live rank 2.

    Ranks 2 and 3 see the death in their all_reduce and revoke; rank 1 leaves its receive with RevokedError.
    """
    results, failures = _run(4, 0, 1, 2)
    reports = _check(results, failures, 0)
    assert reports[0]["error"] == "RevokedError", reports[0]
    for report in reports[1:]:
        assert report["error"] == "PeerLostError" and "rank 0" in report["text"], report


class _Model:
    """Stands for a DDP model (weakly referable)."""


@pytest.mark.timeout(10)
def test_a_kept_error_keeps_no_caller_alive() -> None:
    """An error tcoll keeps (a lost peer's) and raises again through a held call's Work does not keep the frames
    it passed through: else a dropped DDP, held by the frame that ran backward, would live on and its reducer
    would take the gradients of the next backward too (\"marked ready twice\")."""
    from tcoll.torch.work import Held, TcollWork

    kept = tcoll.PeerLostError(2, "its process is gone")

    def start(_: bool) -> list[Any]:
        raise kept

    comm = SimpleNamespace(timeout=5.0)
    work = TcollWork(SimpleNamespace(comm=comm), [], [Held(comm, start)])  # type: ignore[arg-type]
    held: list[weakref.ref[Any]] = []

    def backward() -> None:
        model = _Model()  # what the caller's frame holds
        held.append(weakref.ref(model))
        work.wait()

    for _ in range(2):  # the first wait runs the call, the second raises what it kept
        with pytest.raises(tcoll.PeerLostError) as info:
            backward()
        assert info.value is not kept and str(info.value) == str(kept) and info.value.rank == 2
        del info
        assert held.pop()() is None, "a kept error keeps the caller's frame alive"
