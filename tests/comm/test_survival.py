"""Going on without a dead rank: failed, revoke, agree and shrink, with real SIGKILLs at named points.

A rank that is to die patches the place it dies at (in its own process only),
then makes the calls as the others do; the survivors catch the named error,
revoke, shrink, and run every collective on the new communicator against
NumPy (helpers.survivors). tcoll.spawn(keep_going=True) lets them run on, and
its SpawnError carries every rank's result.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from helpers.survivors import die, every_collective, recover

import tcoll

pytestmark = [pytest.mark.usefixtures("no_leftovers")]

TRANSPORTS = ["shm", "tcp"]
NAMED_WITHIN_S = 5.0  # the bound: every survivor gets a named error this soon after the death


def _run(body: Any, size: int, transport: str, *args: Any) -> tuple[list[Any], dict[int, str]]:
    """Run body on `size` ranks that keep going; (results, failures) (every rank's result, None if it failed)."""
    try:
        return tcoll.spawn(body, size, args, timeout=60, keep_going=True, transport=transport,
                           shm_chunk=4096, coll_chunk=4096), {}
    except tcoll.SpawnError as exc:
        return exc.results, exc.failures


def _survived(results: list[Any], failures: dict[int, str], dead: list[int]) -> list[dict[str, Any]]:
    """Check that exactly `dead` were killed, and return the survivors' reports."""
    assert sorted(failures) == dead, failures
    assert all("SIGKILL" in failures[r] for r in dead), failures
    reports = [results[r] for r in range(len(results)) if r not in dead]
    for report in reports:
        assert report["size"] == len(results) - len(dead), report
        if report["error"] is not None:
            assert report["error"] in ("PeerLostError", "RevokedError", "PeerFailedError"), report
            assert report["after_s"] < NAMED_WITHIN_S, report
    assert sorted(r["rank"] for r in reports) == list(range(len(reports)))
    return reports


def _recover_and_prove(comm: tcoll.Communicator, step: Any) -> dict[str, Any]:
    new, seen = recover(comm, step)
    olds = new.all_gather_object(comm.rank)
    every_collective(new, olds)
    return seen


# -- no death ---------------------------------------------------------------------------------


def _agree_body(comm: tcoll.Communicator) -> list[int]:
    flags = [comm.agree(0b1111 if comm.rank != comm.size - 1 else 0b0110)]
    flags.append(comm.agree(-1))
    flags.append(comm.agree((1 << 62) | comm.rank))
    return flags


@pytest.mark.timeout(60)
@pytest.mark.parametrize("size", [1, 2, 3, 5])
def test_agree_is_the_and_of_every_flag(size: int) -> None:
    flags = [0b1111 if r != size - 1 else 0b0110 for r in range(size)]
    expected = [int(np.bitwise_and.reduce(flags)), -1, int(np.bitwise_and.reduce([(1 << 62) | r for r in range(size)]))]
    assert tcoll.spawn(_agree_body, size, timeout=30) == [expected] * size


def _shrink_healthy(comm: tcoll.Communicator) -> list[int]:
    assert comm.failed() == []
    new = comm.shrink()
    assert (new.rank, new.size) == (comm.rank, comm.size)
    every_collective(new, list(range(comm.size)))
    return new.world_ranks


@pytest.mark.timeout(60)
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_shrink_without_a_death_keeps_every_rank(transport: str) -> None:
    assert tcoll.spawn(_shrink_healthy, 3, timeout=30, transport=transport) == [[0, 1, 2]] * 3


def _revoke_body(comm: tcoll.Communicator) -> dict[str, Any]:
    """Rank 0 revokes while ranks 1 and 2 wait on each other, not on rank 0: they must leave all the same."""
    seen: dict[str, Any] = {}
    buf = np.zeros(4)
    if comm.rank == 0:
        comm.recv(buf, 1, tag=5)  # rank 1 says it is about to block
        comm.revoke()
    else:
        if comm.rank == 1:
            comm.send(buf, 0, tag=5)
        try:
            comm.recv(buf, 3 - comm.rank, tag=9)  # never sent
        except tcoll.RevokedError as exc:
            seen["blocked"] = exc.rank
    for name, call in [("all_reduce", lambda: comm.all_reduce(buf)), ("send", lambda: comm.send(buf, 0)),
                       ("irecv", lambda: comm.irecv(buf, 0)),
                       ("bad argument", lambda: comm.all_reduce(buf, op="no such op"))]:  # the state says first
        try:
            call()
        except tcoll.RevokedError:
            seen[name] = "RevokedError"
    seen["agree"] = comm.agree(1)
    new = comm.shrink()
    every_collective(new, list(range(comm.size)))
    seen["size"] = new.size
    return seen


@pytest.mark.timeout(60)
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_revoke_reaches_ranks_that_wait_on_others(transport: str) -> None:
    results = tcoll.spawn(_revoke_body, 3, timeout=30, transport=transport)
    later = {"all_reduce": "RevokedError", "send": "RevokedError", "irecv": "RevokedError",
             "bad argument": "RevokedError", "agree": 1, "size": 3}
    assert results[0] == later
    assert results[1] == results[2] == dict(later, blocked=0)


def _revoke_past_a_blocked_send_and_a_probe(comm: tcoll.Communicator, how: str) -> dict[str, Any]:
    """Rank 0 sends rank 1 a message larger than the ring that rank 1 never receives (rank 0 blocks in the
    send), rank 2 blocks in a probe for a message that never comes; rank 1 revokes. Both raise RevokedError
    long before the timeout (the send's bytes are drained on the revoked communicator); the survivors'
    new communicator carries a large message between ranks 0 and 1 (the channel is not stuck behind the old
    one)."""
    comm.timeout = 30.0
    seen: dict[str, Any] = {}
    big = np.full(3 << 20, float(comm.rank))  # 24 MiB: more than a ring holds
    flag = np.zeros(1)
    began = time.monotonic()
    if comm.rank == 0:
        comm.send(flag, 1, tag=1)  # "I am about to block"
        try:
            if how == "object":  # (its parts travel on a context of their own)
                comm.send_object({"big": big}, 1, tag=2)
            else:
                comm.send(big, 1, tag=2)
            seen["send"] = "returned"
        except tcoll.RevokedError:
            seen["send"] = "RevokedError"
    elif comm.rank == 1:
        comm.recv(flag, 0, tag=1)
        comm.recv(flag, 2, tag=1)
        time.sleep(0.2)  # (both are inside their calls by now, or about to be: either way they must leave)
        comm.revoke()
    else:
        comm.send(flag, 1, tag=1)
        try:
            comm.probe(0, tag=7)  # never sent
            seen["probe"] = "found"
        except tcoll.RevokedError:
            seen["probe"] = "RevokedError"
    seen["seconds"] = time.monotonic() - began
    new = comm.shrink()
    if new.rank == 0:
        new.send(np.arange(3 << 20, dtype=np.float64), 1, tag=3)
    elif new.rank == 1:
        got = np.empty(3 << 20)
        new.recv(got, 0, tag=3)
        seen["after"] = bool((got == np.arange(3 << 20)).all())
    new.barrier()
    return seen


@pytest.mark.timeout(60)
@pytest.mark.parametrize("how", ["array", "object"])
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_revoke_ends_a_blocked_send_and_a_probe(transport: str, how: str) -> None:
    results = tcoll.spawn(_revoke_past_a_blocked_send_and_a_probe, 3, (how,), timeout=50, transport=transport,
                          shm_ring=1 << 20)
    assert results[0]["send"] == "RevokedError" and results[2]["probe"] == "RevokedError", results
    assert all(r["seconds"] < 10 for r in results), results
    assert results[1]["after"] is True, results


def _revoke_in_a_collective(comm: tcoll.Communicator) -> str:
    """Ranks 1 and 2 wait in an all_reduce that rank 0 never joins; rank 0 revokes: they leave it."""
    flag = np.zeros(1)
    if comm.rank == 0:
        comm.recv(flag, 1, tag=3)
        comm.revoke()
        comm.agree(1)  # (it stays until the others have left their call: its exit is not their news)
        return "revoked"
    if comm.rank == 1:
        comm.send(flag, 0, tag=3)  # (it may be in the all_reduce or about to be: either way it must leave)
    try:
        comm.all_reduce(np.ones(1 << 14))
        said = "completed"
    except tcoll.RevokedError as exc:
        said = f"RevokedError by {exc.rank}"
    comm.agree(1)
    return said


@pytest.mark.timeout(60)
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_revoke_ends_a_collective_that_waits_on_a_live_rank(transport: str) -> None:
    results = tcoll.spawn(_revoke_in_a_collective, 3, timeout=30, transport=transport)
    assert results == ["revoked", "RevokedError by 0", "RevokedError by 0"]


def _agree_or_shrink(comm: tcoll.Communicator, shrinker: int) -> str:
    """Rank `shrinker` calls shrink() where the others call agree(): what each raised, then a vote all make."""
    try:
        if comm.rank == shrinker:
            comm.shrink(timeout=10)
        else:
            comm.agree(1, timeout=10)
        said = "no error"
    except tcoll.MismatchError as exc:
        said = f"MismatchError: {exc}"
    return f"{said} | then {comm.agree(0b10 | comm.rank % 2)}"  # the rounds still pair


@pytest.mark.timeout(60)
@pytest.mark.parametrize("shrinker", [0, 2])
def test_agree_against_shrink_is_a_mismatch_on_every_rank(shrinker: int) -> None:
    said = tcoll.spawn(_agree_or_shrink, 3, (shrinker,), timeout=30, transport="shm")
    assert all(s.startswith("MismatchError: agreement round #1") and s.endswith("| then 2") for s in said), said
    assert all("shrink()" in s and "agree()" in s for s in said), said


def test_agree_refuses_a_flag_that_is_not_64_bits() -> None:
    def body(comm: tcoll.Communicator) -> list[str]:
        said = []
        for flag in (1 << 63, 1.0, True):
            try:
                comm.agree(flag)  # type: ignore[arg-type]
            except ValueError as exc:
                said.append(str(exc))
        return said

    said = tcoll.spawn(body, 2, threads=True, timeout=20)
    assert all(len(s) == 3 and "64 bits" in s[0] for s in said)


# -- deaths at named points -------------------------------------------------------------------


def _before_a_call(comm: tcoll.Communicator) -> Any:
    if comm.rank == 2:
        die()
    return _recover_and_prove(comm, lambda c: c.all_reduce(np.ones(8)))


def _inside_an_arena_step(comm: tcoll.Communicator) -> Any:
    """Rank 1 dies after it published its step of a shared-memory all_reduce, before it read the others'."""
    if comm.rank == 1:
        from tcoll.shm.arena import Arena

        publish = Arena.publish

        def publish_then_die(self: Any, step: int) -> None:
            publish(self, step)
            die()

        Arena.publish = publish_then_die  # type: ignore[method-assign]
        Arena.run_split = Arena.run_small = lambda self, *args: 0  # type: ignore[method-assign] # steps in Python
    x = np.full(64 << 10, float(comm.rank))  # 512 KiB: the split steps
    return _recover_and_prove(comm, lambda c: c.all_reduce(x))


def _inside_a_ring(comm: tcoll.Communicator) -> Any:
    """Rank 3 dies at its 5th message of a pipelined ring all_reduce (chunks of 4 KiB)."""
    if comm.rank == 3:
        from tcoll.algos.team import Team

        send, sent = Team.send, [0]

        def send_then_die(self: Any, *args: Any, **kwargs: Any) -> Any:
            sent[0] += 1
            if sent[0] == 5:
                die()
            return send(self, *args, **kwargs)

        Team.send = send_then_die  # type: ignore[method-assign]
    x = np.full(1 << 16, float(comm.rank))
    return _recover_and_prove(comm, lambda c: c.all_reduce(x, algorithm="ring", async_op=True).wait())


@pytest.mark.timeout(90)
@pytest.mark.parametrize("transport,point,size,dead", [
    (transport, point, size, dead) for transport in TRANSPORTS
    for point, size, dead in [("before_a_call", 4, [2]), ("inside_an_arena_step", 3, [1]), ("inside_a_ring", 5, [3])]
    if not (transport == "tcp" and point == "inside_an_arena_step")])  # (the arena is shared memory's)
def test_survivors_shrink_and_go_on(transport: str, point: str, size: int, dead: list[int]) -> None:
    body = {"before_a_call": _before_a_call, "inside_an_arena_step": _inside_an_arena_step,
            "inside_a_ring": _inside_a_ring}[point]
    reports = _survived(*_run(body, size, transport), dead)
    assert [r for r in reports if r["failed"] != dead] == []
    if point != "before_a_call":  # (there a survivor may have finished its part before the death)
        assert all(r["error"] is not None for r in reports), reports


def _during_agree(comm: tcoll.Communicator, who: str) -> Any:
    """The coordinator (rank 0) dies having told only rank 1 its decision; or a voter dies after voting."""
    from tcoll.comm import survival

    if (who == "coordinator" and comm.rank == 0) or (who == "voter" and comm.rank == 2):
        send, told = survival.Survival._send, [0]

        def send_then_die(self: Any, rank: int, kind: bytes, *args: Any) -> None:
            send(self, rank, kind, *args)
            if kind == (b"D" if who == "coordinator" else b"V"):
                told[0] += 1
                if told[0] == 1:
                    die()

        survival.Survival._send = send_then_die  # type: ignore[method-assign]
    flag = comm.agree(0b11 if comm.rank != 3 else 0b01)
    new = comm.shrink()
    every_collective(new, new.all_gather_object(comm.rank))
    return {"flag": flag, "rank": new.rank, "size": new.size, "error": None, "failed": comm.failed()}


@pytest.mark.timeout(90)
@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("who,dead", [("coordinator", [0]), ("voter", [2])])
def test_agree_gives_every_survivor_one_value_when_a_rank_dies_in_it(transport: str, who: str,
                                                                     dead: list[int]) -> None:
    reports = _survived(*_run(_during_agree, 4, transport, who), dead)
    assert {r["flag"] for r in reports} == {0b01}, reports


def _during_shrink(comm: tcoll.Communicator) -> Any:
    """Rank 2 dies between the two rounds of the shrink: the survivors must leave it out all the same."""
    if comm.rank == 2:
        from tcoll.comm import survival

        agree, rounds = survival.Survival.agree, [0]

        def agree_then_die(self: Any, *args: Any) -> Any:
            rounds[0] += 1
            if rounds[0] == 2:
                die()
            return agree(self, *args)

        survival.Survival.agree = agree_then_die  # type: ignore[method-assign]
    new = comm.shrink()
    olds = new.all_gather_object(comm.rank)
    every_collective(new, olds)
    return {"rank": new.rank, "size": new.size, "error": None, "failed": comm.failed()}


@pytest.mark.timeout(90)
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_rank_that_dies_during_shrink_is_left_out(transport: str) -> None:
    _survived(*_run(_during_shrink, 4, transport), [2])


def _two_in_a_row(comm: tcoll.Communicator) -> Any:
    """Rank 4 dies; the survivors shrink; then the rank that was 1 dies; they shrink again."""
    if comm.rank == 4:
        die()
    first, seen = recover(comm, lambda c: c.all_reduce(np.ones(16)))
    if comm.rank == 1:
        die()
    second, again = recover(first, lambda c: c.all_reduce(np.ones(16)))
    olds = second.all_gather_object(comm.rank)
    every_collective(second, olds)
    return {**again, "olds": olds, "first_failed": seen["failed"]}


@pytest.mark.timeout(90)
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_two_ranks_die_one_after_the_other(transport: str) -> None:
    reports = _survived(*_run(_two_in_a_row, 5, transport), [1, 4])
    assert [r for r in reports if (r["olds"], r["first_failed"], r["failed"]) != ([0, 2, 3], [4], [1])] == []


def _split_then_die(comm: tcoll.Communicator) -> Any:
    """Ranks split by parity; rank 2 (even) dies: the evens' communicator shrinks, the odds' goes on untouched."""
    sub = comm.split(comm.rank % 2)
    assert sub is not None
    if comm.rank == 2:
        die()
    if comm.rank % 2:
        failed = sub.failed()  # (before the last call: a peer that finished and closed counts as gone)
        every_collective(sub, [0, 1])
        return {"size": sub.size, "failed": failed}
    new, seen = recover(sub, lambda c: c.all_reduce(np.ones(8)))
    every_collective(new, new.all_gather_object(sub.rank))
    return {"size": new.size, "failed": seen["failed"]}


@pytest.mark.timeout(90)
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_split_communicator_shrinks_over_its_own_ranks(transport: str) -> None:
    results, failures = _run(_split_then_die, 5, transport)
    assert sorted(failures) == [2], failures
    evens, odds = {"size": 2, "failed": [1]}, {"size": 2, "failed": []}  # world rank 2 is the evens' rank 1
    assert [results[r] for r in (0, 1, 3, 4)] == [evens, odds, odds, evens], results


def _close_beside_the_dead(comm: tcoll.Communicator) -> Any:
    """Rank 1 dies; rank 0's barrier raises within the liveness period, and close() returns at once."""
    import time

    if comm.rank == 1:
        die()
    began = time.monotonic()
    try:
        comm.barrier()
        error = None
    except tcoll.TcollError as exc:
        error = type(exc).__name__
    raised = time.monotonic() - began
    began = time.monotonic()
    comm.close()
    return {"error": error, "raised_s": raised, "closed_s": time.monotonic() - began}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_barrier_and_close_beside_a_dead_rank_never_hang(transport: str) -> None:
    results, failures = _run(_close_beside_the_dead, 2, transport)
    assert sorted(failures) == [1], failures
    found = results[0]
    assert found["error"] == "PeerLostError" and found["raised_s"] < NAMED_WITHIN_S, found
    assert found["closed_s"] < 2.0, found


class _Held:
    """Something a caller's frame holds (a model, its buffers)."""


def _keep_nothing_of_the_caller(comm: tcoll.Communicator) -> Any:
    """Rank 1 leaves; rank 0 calls it three times: each error lets the caller's frame go, and does not grow."""
    import gc
    import traceback
    import weakref

    if comm.rank == 1:
        return None
    seen = []
    for _ in range(3):
        held = _Held()
        alive = weakref.ref(held)

        def call(holding: _Held = held) -> None:
            comm.recv(np.zeros(1), 1)

        try:
            call()
        except tcoll.PeerLostError as exc:
            depth = len(list(traceback.walk_tb(exc.__traceback__)))
        del held, call
        gc.collect()
        seen.append((alive() is None, depth))
    return seen


@pytest.mark.timeout(60)
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_the_error_of_a_lost_peer_keeps_no_callers_frames(transport: str) -> None:
    """The engine keeps a lost peer's error for good, and Works keep theirs: what a caller gets is a copy."""
    results = tcoll.spawn(_keep_nothing_of_the_caller, 2, timeout=30, transport=transport)
    freed = [gone for gone, _ in results[0]]
    depths = [depth for _, depth in results[0]]
    # (the first call meets the death; the later ones the kept error, raised again: its traceback must not grow)
    assert freed == [True, True, True] and depths[1] == depths[2], results[0]


def _right_after_a_new_communicator(comm: tcoll.Communicator) -> list[Any]:
    """agree and revoke at once on communicators just made: a rank that made it first may speak before the
    others have it (its notices wait for them, they are not lost)."""
    said: list[Any] = [comm.dup().agree(1 << comm.rank | 8) for _ in range(10)]
    for _ in range(5):
        sub = comm.split(comm.rank % 2)
        assert sub is not None
        if sub.rank == 0:
            sub.revoke()
        try:
            sub.barrier()
            said.append("completed")
        except tcoll.RevokedError:
            said.append("revoked")
        comm.barrier()
    return said


@pytest.mark.timeout(60)
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_agree_and_revoke_right_after_dup_and_split(transport: str) -> None:
    results = tcoll.spawn(_right_after_a_new_communicator, 3, timeout=40, transport=transport)
    assert results == [[8] * 10 + ["revoked"] * 5] * 3


def _revoked_between_calls(comm: tcoll.Communicator) -> str:
    """Rank 0's last call only sent (the root of a broadcast); rank 1 revokes before rank 0's next call: the
    poll that call starts with takes the revoke in, and the call raises it instead of waiting."""
    x = np.ones(4)
    comm.broadcast(x, root=0, algorithm="binomial")
    if comm.rank == 1:
        comm.revoke()
        comm.agree(1)
        return "revoked"
    try:
        comm.all_reduce(x)
        said = "completed"
    except tcoll.RevokedError:
        said = "RevokedError"
    comm.agree(1)
    return said


@pytest.mark.timeout(60)
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_revoke_that_comes_between_calls_ends_the_next_one(transport: str) -> None:
    results = tcoll.spawn(_revoked_between_calls, 2, timeout=40, transport=transport, env={"TCOLL_TIMEOUT": "20"})
    assert results == ["RevokedError", "revoked"]


def _decided_then_left(comm: tcoll.Communicator) -> Any:
    """The coordinator (rank 0, voting 0b01) tells only rank 2 its decision, and dies once rank 2 took it;
    rank 2 returns and leaves at once. Ranks 1 and 3 (voting 0b11) must still return rank 2's value, not a new
    AND of theirs. (Rank 0 waits for rank 2's word: should rank 2 hear of rank 0's death from another rank
    before it reads the decision, it would not take it, and the survivors would rightly decide anew.)"""
    from tcoll.comm import survival

    took = Path(tempfile.gettempdir()) / f"tcoll-test-{comm.run_id}-took"
    if comm.rank == 0:
        send = survival.Survival._send

        def tell_rank_2_only(self: Any, rank: int, kind: bytes, *args: Any) -> Any:
            if kind != b"D":
                return send(self, rank, kind, *args)
            if rank == 2:
                send(self, rank, kind, *args)
                deadline = time.monotonic() + 20
                while not took.exists() and time.monotonic() < deadline:
                    time.sleep(0.005)
                took.unlink(missing_ok=True)
                die()
            return None

        survival.Survival._send = tell_rank_2_only  # type: ignore[method-assign]
    value = comm.agree(0b01 if comm.rank == 0 else 0b11, timeout=20)
    if comm.rank == 2:
        took.write_text(str(value))
    return value


@pytest.mark.timeout(60)
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_decision_taken_by_a_rank_that_left_still_stands(transport: str) -> None:
    results, failures = _run(_decided_then_left, 4, transport)
    assert sorted(failures) == [0], failures
    assert results[1:] == [0b01, 0b01, 0b01], results
