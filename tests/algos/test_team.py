"""Team: the tags a collective call's messages carry, its phases, and how a failed call is withdrawn.

A stand-in engine records what the Team asks of it, so the arithmetic of
tags is checked without any message moving: tag = sequence * 64 + phase * 8
+ stream, in the communicator's collective context.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import pytest

from tcoll.algos.team import SUBTAGS, CollectiveWork, Team
from tcoll.p2p.work import RecvWork, SendWork


class RecordingEngine:
    """What Team calls on an engine, recorded; sends complete at once, receives stay pending."""

    def __init__(self) -> None:
        self.sent: list[tuple[int, int, int, int]] = []  # (world peer, ctx, tag, nbytes)
        self.stamps: list[int] = []
        self.posted: list[RecvWork] = []
        self.cancelled: list[RecvWork] = []
        self.abandoned: list[tuple[int, int, int]] = []
        self.in_progress = 0
        self.deferred: list[Any] = []
        self.lock = threading.RLock()

    def isend(self, data: np.ndarray, peer: int, ctx: int, tag: int, user: Any = None, stamp: int = 0) -> SendWork:
        self.sent.append((peer, ctx, tag, data.nbytes))
        self.stamps.append(stamp)
        work = SendWork(self, peer, ctx, tag, data, user, stamp)  # type: ignore[arg-type]
        work._finish(user)
        return work

    def irecv(self, data: np.ndarray, peer: int, ctx: int, tag: int, user: Any = None,
              stamp: int | None = None) -> RecvWork:
        work = RecvWork(self, peer, ctx, tag, data, user, stamp=stamp)  # type: ignore[arg-type]
        self.posted.append(work)
        return work

    def cancel(self, work: RecvWork) -> bool:
        self.cancelled.append(work)
        work._fail(RuntimeError("cancelled"))
        return True

    def abandon(self, ctx: int, lo: int, hi: int) -> None:
        self.abandoned.append((ctx, lo, hi))


WORLD = [10, 11, 12, 13]  # the communicator's ranks are world ranks 10..13


def _team(engine: RecordingEngine, sequence: int = 5, stamp: int = 0) -> Team:
    return Team(engine, WORLD, 1, 9, sequence, 1024, stamp)  # type: ignore[arg-type]


def test_messages_carry_the_call_tag_in_the_collective_context() -> None:
    engine = RecordingEngine()
    team = _team(engine, sequence=5)
    team.send(np.zeros(4, dtype=np.float32), 2)
    team.send(np.zeros(1, dtype=np.uint8), 3, sub=6)
    assert engine.sent == [(12, 9, 5 * SUBTAGS, 16), (13, 9, 5 * SUBTAGS + 6, 1)]


def test_phases_add_eight_streams_each_and_nest() -> None:
    engine = RecordingEngine()
    team = _team(engine, sequence=2)
    team.phase(3).send(np.zeros(1), 0, sub=1)
    team.phase(1).phase(2).send(np.zeros(1), 0)
    assert [tag for _, _, tag, _ in engine.sent] == [2 * SUBTAGS + 3 * 8 + 1, 2 * SUBTAGS + 3 * 8]


def test_a_call_has_eight_phases() -> None:
    team = _team(RecordingEngine())
    team.phase(7)
    with pytest.raises(ValueError, match="8 phases"):
        team.phase(8)
    with pytest.raises(ValueError):
        team.phase(4).phase(4)


def test_receives_into_read_only_memory_are_refused() -> None:
    buf = np.zeros(4)
    buf.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        _team(RecordingEngine()).recv(buf, 0)


def test_a_chunk_holds_whole_items() -> None:
    team = _team(RecordingEngine())
    assert team.chunk_count(8) == 128 and team.chunk_count(3000) == 1 and team.chunk_count(0) == 1024


def test_withdraw_cancels_every_phase_and_drops_the_calls_tags() -> None:
    engine = RecordingEngine()
    team = _team(engine, sequence=3)
    first = team.recv(np.zeros(2), 0)
    second = team.phase(2).recv(np.zeros(2), 1)
    team.withdraw()
    assert engine.cancelled == [first, second]
    assert engine.abandoned == [(9, 3 * SUBTAGS, 4 * SUBTAGS)]


def test_a_collective_work_steps_its_algorithm_and_fails_with_it() -> None:
    engine = RecordingEngine()
    team = _team(engine)
    seen = []

    def algorithm() -> Any:
        box = np.zeros(1)
        yield team.recv(box, 0)
        seen.append(float(box[0]))
        raise ValueError("from the algorithm")

    work = CollectiveWork(engine, algorithm(), "test #5", team).start()  # type: ignore[arg-type]
    assert not work.finished and len(engine.posted) == 1
    recv = engine.posted[0]
    recv.data[:] = np.array([2.5]).view(np.uint8)  # as a transport would fill it
    recv.nbytes = recv.offset = 8
    recv._finish(None)
    assert seen == [2.5]
    assert isinstance(work.exception(), ValueError)


def test_a_short_message_is_a_mismatch_naming_the_sender() -> None:
    from tcoll.errors import MismatchError

    engine = RecordingEngine()
    team = _team(engine)

    def algorithm() -> Any:
        yield team.recv(np.zeros(4), 2)

    description = "all_reduce #5 (ring, 32 B per rank)"
    work = CollectiveWork(engine, algorithm(), description, team).start()  # type: ignore[arg-type]
    recv = engine.posted[0]
    recv.nbytes = recv.offset = 8
    recv._finish(None)
    error = work.exception()
    assert isinstance(error, MismatchError)
    assert "all_reduce #5" in str(error) and "rank 2 sent 8 bytes where 32 were expected" in str(error)  # the communicator's rank, not the world's


def test_every_message_and_receive_of_a_call_carries_its_stamp_in_every_phase() -> None:
    engine = RecordingEngine()
    team = _team(engine, stamp=123 | 7 << 64)
    team.send(np.zeros(1), 0)
    team.phase(3).send(np.zeros(1), 2)
    team.phase(1).recv(np.zeros(1), 3)
    assert engine.stamps == [123 | 7 << 64] * 2
    assert engine.posted[0].stamp == 123 | 7 << 64
