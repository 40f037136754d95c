"""The engine on its own, driven through the loopback transport: matching, unexpected messages, cancel, failure.

Two engines live in this process, connected by loopback channels (the
transport for ranks that are threads), and the test drives both from one
thread, step by step: post on one, poll the other, look at the Works. The
loopback transport copies eagerly up to the eager limit and hands larger
messages over by reference, so both paths of `Engine.match` are reached.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

import numpy as np
import pytest

from tcoll.env import Settings
from tcoll.errors import MessageSizeError, PeerLostError, TcollError, TimeoutError
from tcoll.p2p.engine import Engine
from tcoll.p2p.waiting import Doorbell
from tcoll.p2p.work import wait_any
from tcoll.store.memory import MemoryStore
from tcoll.transport.loopback import LoopbackTransport

CTX = 4
EAGER = 1024


@pytest.fixture(name="pair")
def pair_fixture() -> Iterator[tuple[Engine, Engine]]:
    """Two connected engines (ranks 0 and 1) with a small eager limit."""
    settings = Settings(eager_limit=EAGER, timeout=5.0)
    store = MemoryStore()
    engines = [Engine(rank, 2, settings, Doorbell.private()) for rank in range(2)]
    transports = [LoopbackTransport(engine, settings, "engine-test") for engine in engines]
    for transport in transports:
        transport.prepare()
    threads = [threading.Thread(target=_connect, args=(transports[r], engines[r], 1 - r, store)) for r in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    yield engines[0], engines[1]
    for engine, transport in zip(engines, transports):
        engine.close()
        transport.close()


def _connect(transport: LoopbackTransport, engine: Engine, peer: int, store: MemoryStore) -> None:
    for channel in transport.connect([peer], [{}, {}], store, 5.0).values():
        engine.add_channel(channel)


def _bytes(n: int, seed: int) -> np.ndarray:
    return ((np.arange(n) * 7 + seed) % 251).astype(np.uint8)


def test_a_posted_receive_gets_the_message(pair: tuple[Engine, Engine]) -> None:
    a, b = pair
    box = np.zeros(16, dtype=np.uint8)
    recv = b.irecv(box, 0, CTX, 3)
    send = a.isend(_bytes(16, 1), 1, CTX, 3)
    recv.wait(5)
    send.wait(5)
    np.testing.assert_array_equal(box, _bytes(16, 1))
    assert recv.nbytes == 16


@pytest.mark.parametrize("nbytes", [0, 100, EAGER, EAGER + 1, 50_000])
def test_unexpected_messages_keep_their_order_per_tag(pair: tuple[Engine, Engine], nbytes: int) -> None:
    a, b = pair
    sends = [a.isend(_bytes(nbytes, k), 1, CTX, 9) for k in range(3)]
    b.poll()  # the messages arrive before any receive: small ones are copied aside, large ones wait
    boxes = [np.zeros(nbytes, dtype=np.uint8) for _ in range(3)]
    for box in boxes:
        b.irecv(box, 0, CTX, 9).wait(5)
    for work in sends:
        work.wait(5)
    for k, box in enumerate(boxes):
        np.testing.assert_array_equal(box, _bytes(nbytes, k))


def test_tags_and_contexts_never_match_each_other(pair: tuple[Engine, Engine]) -> None:
    a, b = pair
    a.isend(np.array([1], dtype=np.uint8), 1, CTX, 1)
    a.isend(np.array([2], dtype=np.uint8), 1, CTX + 1, 1)
    a.isend(np.array([3], dtype=np.uint8), 1, CTX, 2)
    got = {}
    for ctx, tag in [(CTX, 2), (CTX + 1, 1), (CTX, 1)]:
        box = np.zeros(1, dtype=np.uint8)
        b.irecv(box, 0, ctx, tag).wait(5)
        got[(ctx, tag)] = int(box[0])
    assert got == {(CTX, 1): 1, (CTX + 1, 1): 2, (CTX, 2): 3}


def test_a_shorter_message_fills_part_of_the_buffer_and_a_longer_one_fails(pair: tuple[Engine, Engine]) -> None:
    a, b = pair
    box = np.zeros(8, dtype=np.uint8)
    a.isend(_bytes(5, 2), 1, CTX, 0)
    recv = b.irecv(box, 0, CTX, 0)
    recv.wait(5)
    assert recv.nbytes == 5
    np.testing.assert_array_equal(box[:5], _bytes(5, 2))
    a.isend(_bytes(20, 3), 1, CTX, 0)
    with pytest.raises(MessageSizeError):
        b.irecv(np.zeros(8, dtype=np.uint8), 0, CTX, 0).wait(5)


def test_a_cancelled_receive_lets_the_next_one_have_the_message(pair: tuple[Engine, Engine]) -> None:
    a, b = pair
    first = b.irecv(np.zeros(4, dtype=np.uint8), 0, CTX, 5)
    assert first.cancel() is True
    with pytest.raises(TcollError, match="cancelled"):
        first.wait(1)
    second_box = np.zeros(4, dtype=np.uint8)
    second = b.irecv(second_box, 0, CTX, 5)
    a.isend(_bytes(4, 4), 1, CTX, 5)
    second.wait(5)
    np.testing.assert_array_equal(second_box, _bytes(4, 4))
    assert second.cancel() is False  # done: nothing to withdraw


def test_a_receive_posted_on_a_withdrawn_context_fails_at_once(pair: tuple[Engine, Engine]) -> None:
    # Another thread revoked or closed the communicator between this thread's checks and its post.
    a, b = pair
    b.withdraw(CTX, TcollError("the communicator is revoked"))
    late = b.irecv(np.zeros(4, dtype=np.uint8), 0, CTX, 6)
    with pytest.raises(TcollError, match="revoked"):
        late.wait(0.5)  # not its timeout: it failed when it was posted
    other = b.irecv(np.zeros(4, dtype=np.uint8), 0, CTX + 1, 6)  # another context still works
    a.isend(_bytes(4, 1), 1, CTX + 1, 6)
    other.wait(5)


def test_abandoned_tags_drop_late_messages(pair: tuple[Engine, Engine]) -> None:
    a, b = pair
    b.abandon(CTX, 100, 164)
    a.isend(_bytes(8, 5), 1, CTX, 120).wait(5)
    a.isend(_bytes(8, 6), 1, CTX, 200).wait(5)
    b.poll()
    box = np.zeros(8, dtype=np.uint8)
    b.irecv(box, 0, CTX, 200).wait(5)  # a tag outside the range is delivered as usual
    np.testing.assert_array_equal(box, _bytes(8, 6))
    late = b.irecv(np.zeros(8, dtype=np.uint8), 0, CTX, 120)
    with pytest.raises(TimeoutError):
        late.wait(0.2)  # the dropped message never reaches it


def test_a_self_message_completes_at_once(pair: tuple[Engine, Engine]) -> None:
    a, _ = pair
    box = np.zeros(3, dtype=np.uint8)
    recv = a.irecv(box, 0, CTX, 7)
    a.isend(_bytes(3, 8), 0, CTX, 7)
    assert recv.done()
    np.testing.assert_array_equal(box, _bytes(3, 8))


def test_a_timeout_names_the_peer_it_waits_on(pair: tuple[Engine, Engine]) -> None:
    _, b = pair
    recv = b.irecv(np.zeros(1, dtype=np.uint8), 0, CTX, 11)
    with pytest.raises(TimeoutError, match=r"still waiting on rank\(s\) \[0\]") as info:
        recv.wait(0.1)
    assert info.value.peers == [0]


def test_a_lost_peer_fails_pending_and_later_operations(pair: tuple[Engine, Engine]) -> None:
    a, b = pair
    pending = b.irecv(np.zeros(1, dtype=np.uint8), 0, CTX, 12)
    b.fail_peer(0, PeerLostError(0, "test"))
    with pytest.raises(PeerLostError, match="peer rank 0 is lost"):
        pending.wait(1)
    with pytest.raises(PeerLostError):
        b.irecv(np.zeros(1, dtype=np.uint8), 0, CTX, 12)
    assert b.is_lost(0) and not a.is_lost(1)


def test_wait_any_returns_the_first_complete(pair: tuple[Engine, Engine]) -> None:
    a, b = pair
    works = [b.irecv(np.zeros(1, dtype=np.uint8), 0, CTX, tag) for tag in (20, 21, 22)]
    a.isend(np.array([9], dtype=np.uint8), 1, CTX, 21)
    assert wait_any(works, 5) == 1
    with pytest.raises(TimeoutError):
        wait_any([works[0], works[2]], 0.1)
    with pytest.raises(ValueError):
        wait_any([])


def test_close_fails_what_is_pending(pair: tuple[Engine, Engine]) -> None:
    _, b = pair
    pending = b.irecv(np.zeros(1, dtype=np.uint8), 0, CTX, 30)
    b.close()
    with pytest.raises(TcollError, match="closed"):
        pending.wait(1)
    with pytest.raises(TcollError, match="closed"):
        b.isend(np.zeros(1, dtype=np.uint8), 0, CTX, 30)
