"""The lean blocking send and receive between ranks of one host (tcoll.transport.shm._ring_kernel).

A blocking send writes its message straight into the peer's ring and a
blocking receive takes the next message of its ring when nothing else could
claim it; every other case goes through the engine. The kernel is checked
on its own, byte for byte against the Python ring code at every wrap
position (the two must write and read the same stream), and then in rank
processes for what the engine guarantees: per-tag order mixed with
non-blocking and large messages, earlier-posted receives and wildcards
first, early messages kept, size errors, collectives in between, full
rings; with the kernel and without it (TCOLL_SHM_KERNEL=off).
"""

from __future__ import annotations

import mmap

import ml_dtypes
import numpy as np
import pytest
from helpers.procs import spawn_as

import tcoll
from tcoll import ANY_SOURCE, ANY_TAG
from tcoll.errors import MessageSizeError
from tcoll.p2p.channel import HEADER, pack_header, unpack_header
from tcoll.transport.shm import rings as layout

kernel = layout.ring_kernel
needs_kernel = pytest.mark.skipif(kernel is None, reason="the ring kernel was not built (no compiler)")

SIZE = 4096
CTX, TAG = 4, 9
BFLOAT16 = np.dtype(ml_dtypes.bfloat16)


class Pair:
    """Two rings on anonymous memory and a doorbell: `rings` writes `out` and reads `inbound`."""

    def __init__(self) -> None:
        self.map = mmap.mmap(-1, 2 * (layout.RING_CTL + SIZE) + mmap.PAGESIZE)
        self.inbound = layout.Ring(self.map, 0, SIZE)
        self.out = layout.Ring(self.map, layout.RING_CTL + SIZE, SIZE)
        self.bell = memoryview(self.map)[-mmap.PAGESIZE:-mmap.PAGESIZE + 8].cast("I")
        self.rings = kernel.Rings(self.inbound.ctl, self.inbound.mv, self.out.ctl, self.out.mv, self.bell)

    def at(self, ring: layout.Ring, position: int) -> None:
        """Make `ring` empty at stream position `position`."""
        ring.ctl[layout.HEAD] = ring.ctl[layout.TAIL] = position

    def put(self, position: int, payload: bytes, ctx: int = CTX, tag: int = TAG, magic_ok: bool = True) -> int:
        """Write a message into the inbound ring the Python way (as a peer's channel does); its end."""
        header = pack_header(ctx, tag, len(payload))
        if not magic_ok:
            header = b"\x00" * 4 + header[4:]
        layout.write(self.inbound, position, header)
        layout.write(self.inbound, position + HEADER.size, payload)
        self.inbound.ctl[layout.HEAD] = position + HEADER.size + len(payload)
        return position + HEADER.size + len(payload)

    def close(self) -> None:
        self.rings = None
        self.inbound.release()
        self.out.release()
        self.bell.release()
        self.map.close()


@pytest.fixture(name="pair")
def pair_fixture() -> Pair:
    pair = Pair()
    yield pair
    pair.close()


def _payload(n: int, seed: int) -> np.ndarray:
    return ((np.arange(n, dtype=np.int64) * 131 + seed) % 251).astype(np.uint8)


WRAPS = [0, 1, SIZE - HEADER.size, SIZE - HEADER.size + 1, SIZE - 1, SIZE - 20, SIZE - 100, 7 * SIZE + 3]


@needs_kernel
@pytest.mark.parametrize("start", WRAPS)
@pytest.mark.parametrize("count", [0, 1, 60, 1000, SIZE - HEADER.size])
def test_what_the_kernel_sends_the_python_reader_reads(pair: Pair, start: int, count: int) -> None:
    pair.at(pair.out, start)
    data = _payload(count, start)
    head = pair.rings.send(CTX, TAG, data)
    assert head == start + HEADER.size + count == pair.out.ctl[layout.HEAD]
    assert unpack_header(layout.read_header(pair.out, start), peer=1) == (CTX, TAG, count, 0)
    got = np.zeros(count, dtype=np.uint8)
    layout.read(pair.out, start + HEADER.size, got, 0, count)
    np.testing.assert_array_equal(got, data)


@needs_kernel
@pytest.mark.parametrize("start", WRAPS)
@pytest.mark.parametrize("count", [0, 1, 60, 1000, SIZE - HEADER.size])
def test_what_python_writes_the_kernel_receives(pair: Pair, start: int, count: int) -> None:
    pair.at(pair.inbound, start)
    data = _payload(count, start + 1)
    end = pair.put(start, data.tobytes())
    out = np.full(count + 8, 7, dtype=np.uint8)  # a longer buffer: the message may be shorter
    assert pair.rings.recv(CTX, TAG, out, 0, False) == end == pair.inbound.ctl[layout.TAIL]
    np.testing.assert_array_equal(out[:count], data)
    assert (out[count:] == 7).all()  # nothing written past the message


@needs_kernel
def test_a_stream_of_messages_round_trips_through_both_kernels(pair: Pair) -> None:
    """Many messages of odd sizes through a ring the reader drains: every wrap, in one stream."""
    reader = kernel.Rings(pair.out.ctl, pair.out.mv, pair.inbound.ctl, pair.inbound.mv, pair.bell)
    head = tail = 0
    rng = np.random.default_rng(5)
    for i in range(400):
        data = rng.integers(0, 256, int(rng.integers(0, 1500)), dtype=np.uint8)
        head = pair.rings.send(CTX, i, data)
        out = np.empty(1500, dtype=np.uint8)
        tail = reader.recv(CTX, i, out, 0, False)
        assert tail == head
        np.testing.assert_array_equal(out[:data.size], data)


@needs_kernel
def test_the_receiver_leaves_what_is_not_its_message(pair: Pair) -> None:
    rings, tail = pair.rings, 100
    pair.at(pair.inbound, tail)
    assert rings.recv(CTX, TAG, bytearray(8), 0, False) == kernel.NOTHING_YET
    assert rings.recv(CTX, TAG, bytearray(8), 200_000, False) == kernel.NOTHING_YET  # spun, none came
    pair.put(tail, b"12345678", tag=TAG + 1)
    assert rings.recv(CTX, TAG, bytearray(8), 0, False) == kernel.NOT_MINE  # another tag
    pair.put(tail, b"12345678", ctx=CTX + 1)
    assert rings.recv(CTX, TAG, bytearray(8), 0, False) == kernel.NOT_MINE  # another context
    pair.put(tail, b"123456789")
    assert rings.recv(CTX, TAG, bytearray(8), 0, False) == kernel.NOT_MINE  # too large for the buffer
    pair.put(tail, b"12345678", magic_ok=False)
    assert rings.recv(CTX, TAG, bytearray(8), 0, False) == kernel.NOT_MINE  # not a header: Python says so
    pair.put(tail, b"12345678")
    pair.inbound.ctl[layout.HEAD] = tail + HEADER.size + 4  # half the payload so far
    assert rings.recv(CTX, TAG, bytearray(8), 100_000, False) == kernel.NOT_MINE
    assert rings.recv(CTX, TAG, bytes(8), 0, False) == kernel.NOT_MINE  # read-only buffer
    assert rings.recv(CTX, TAG, np.zeros(2, dtype=object), 0, False) == kernel.NOT_MINE
    assert pair.inbound.ctl[layout.TAIL] == tail  # nothing was taken
    pair.inbound.ctl[layout.HEAD] = tail + HEADER.size + 8
    out = bytearray(8)
    assert rings.recv(CTX, TAG, out, 0, False) == tail + HEADER.size + 8 and out == b"12345678"


@needs_kernel
def test_the_sender_writes_nothing_without_room_or_for_what_it_will_not_take(pair: Pair) -> None:
    rings = pair.rings
    pair.at(pair.out, 0)
    pair.out.ctl[layout.HEAD] = SIZE - 100  # the reader is 100 bytes of room behind
    assert rings.send(CTX, TAG, bytes(61)) == kernel.NO_ROOM  # 40 + 61 > 100
    assert rings.send(CTX, TAG, np.zeros(2, dtype=object)) == kernel.NO_ROOM  # pointers are no data
    assert rings.send(CTX, TAG, np.zeros((4, 4))[:, 0]) == kernel.NO_ROOM  # not contiguous
    assert pair.out.ctl[layout.HEAD] == SIZE - 100
    assert rings.send(CTX, TAG, bytes(60)) == SIZE  # exactly full


@needs_kernel
def test_a_sleeping_peer_is_woken_and_an_awake_one_costs_nothing(pair: Pair) -> None:
    pair.at(pair.out, 0)
    before = pair.bell[0]
    pair.rings.send(CTX, TAG, b"x")
    assert pair.bell[0] == before  # nobody sleeps: no system call, the sequence stays
    pair.bell[1] = 1  # the peer announced a sleeper
    pair.rings.send(CTX, TAG, b"y")
    assert pair.bell[0] == before + 1  # FUTEX_WAKE_OP bumped the sequence
    pair.put(0, b"z")
    pair.rings.recv(CTX, TAG, bytearray(1), 0, False)
    assert pair.bell[0] == before + 2  # a receive that frees room rings the writer too


# -- in rank processes ------------------------------------------------------------------

KERNELS = ["auto", "off"]


LEAN = {"shm_ring": SIZE, "shm_chunk": 1024, "timeout": 60}  # the settings of every rank process below


def mixed_order(comm: tcoll.Communicator, count: int) -> bool:
    """Blocking, non-blocking, ring-filling and larger-than-ring messages on one tag arrive in order."""
    sizes = [(i * 37) % 300 if i % 5 else 3 * SIZE + i for i in range(count)]
    if comm.rank == 0:
        pending = []
        for i, n in enumerate(sizes):
            data = np.full(n, i % 251, dtype=np.uint8)
            if i % 3 == 1:
                pending.append(comm.isend(data, 1, TAG))
            else:
                comm.send(data, 1, TAG)
        for work in pending:
            work.wait()
    else:
        for i, n in enumerate(sizes):
            out = np.full(3 * SIZE + count, 255, dtype=np.uint8)
            if i % 4 == 3:
                work = comm.irecv(out, 0, TAG)
                work.wait()
                assert work.nbytes == n
            else:
                comm.recv(out, 0, TAG)
            assert (out[:n] == i % 251).all() and (out[n:] == 255).all(), i
    return True


@pytest.mark.timeout(90)
@pytest.mark.parametrize("shm_kernel", KERNELS)
def test_messages_of_every_kind_keep_their_order(shm_kernel: str) -> None:
    assert spawn_as("shm", mixed_order, 2, 120, shm_kernel=shm_kernel, **LEAN) == [True, True]


def claimed_first(comm: tcoll.Communicator) -> bool:
    """An earlier-posted receive, a wildcard and a kept early message each take their message first."""
    one = np.zeros(1, dtype=np.int64)
    if comm.rank == 0:
        for value, tag in [(1, 5), (2, 5), (3, 6), (4, 6), (5, 7), (6, 8)]:
            comm.send(np.array([value]), 1, tag)
        comm.recv(one, 1, 0)  # rank 1 has posted its receive for tag 9
        comm.send(np.array([7]), 1, 9)
        comm.send(np.array([8]), 1, 9)
        return True
    early = comm.irecv(np.zeros(1, dtype=np.int64), 0, 5)  # posted before the blocking receive of tag 5
    wild = comm.irecv(np.zeros(1, dtype=np.int64), ANY_SOURCE, 6)
    got = [int(comm.recv(one, 0, 5)[0]), int(comm.recv(one, 0, 6)[0])]
    got += [int(comm.recv(one, 0, 8)[0]), int(comm.recv(one, 0, 7)[0])]  # tag 7 came first: kept aside
    probe = comm.irecv(np.zeros(1, dtype=np.int64), ANY_SOURCE, ANY_TAG)
    comm.send(one, 0, 0)
    got.append(int(comm.recv(one, 0, 9)[0]))
    return [int(early.wait()[0]), int(wild.wait()[0]), int(probe.wait()[0])] + got == [1, 3, 7, 2, 4, 6, 5, 8]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("shm_kernel", KERNELS)
def test_earlier_receives_and_wildcards_come_first(shm_kernel: str) -> None:
    assert spawn_as("shm", claimed_first, 2, shm_kernel=shm_kernel, **LEAN) == [True, True]


def sizes_and_collectives(comm: tcoll.Communicator) -> bool:
    """Too-long messages fail the receive (and only it); collectives' messages in between are theirs."""
    if comm.rank == 0:
        comm.send(np.arange(9, dtype=np.uint8), 1, 1)
        comm.send(np.arange(3, dtype=np.uint8), 1, 1)
        comm.send(np.arange(4, dtype=np.uint8), 1, 2)  # waits in the ring while the collective runs
    out = np.zeros(8, dtype=np.uint8)
    if comm.rank == 1:
        with pytest.raises(MessageSizeError, match="9 bytes"):
            comm.recv(out, 0, 1)
        assert comm.recv(out, 0, 1) is out and list(out[:3]) == [0, 1, 2]
    x = np.full(1000, comm.rank + 1.0)
    comm.all_reduce(x, algorithm="ring")
    assert (x == 3.0).all()
    if comm.rank == 1:
        assert list(comm.recv(out, 0, 2)[:4]) == [0, 1, 2, 3]
    return True


@pytest.mark.timeout(60)
@pytest.mark.parametrize("shm_kernel", KERNELS)
def test_size_errors_and_collectives_between_messages(shm_kernel: str) -> None:
    assert spawn_as("shm", sizes_and_collectives, 2, shm_kernel=shm_kernel, **LEAN) == [True, True]


def many_to_one(comm: tcoll.Communicator, count: int) -> bool:
    """Every rank streams to rank 0, which takes them source by source: rings fill and wrap."""
    if comm.rank:
        for i in range(count):
            comm.send(np.full(1 + (i * 53 + comm.rank) % 900, i, dtype=np.int32), 0, comm.rank)
        return True
    out = np.empty(900, dtype=np.int32)
    for i in range(count):
        for src in range(1, comm.size):
            comm.recv(out, src, src)
            n = 1 + (i * 53 + src) % 900
            assert (out[:n] == i).all(), (src, i)
    return True


@pytest.mark.timeout(90)
@pytest.mark.parametrize("size", [3, 5])
def test_streams_from_several_peers_fill_and_wrap_their_rings(size: int) -> None:
    assert spawn_as("shm", many_to_one, size, 150, shm_kernel="auto", **LEAN) == [True] * size


def _count_engine_posts(comm: tcoll.Communicator) -> list[int]:
    """From now on, count in the list's one item the sends and receives the engine's isend/irecv post."""
    comm.barrier()  # (its first call sets up the arena, through the engine)
    engine, counted = comm.core.engine, [0]
    isend, irecv = engine.isend, engine.irecv

    def counting(post):
        def call(*args, **kwargs):
            counted[0] += 1
            return post(*args, **kwargs)
        return call

    engine.isend, engine.irecv = counting(isend), counting(irecv)
    return counted


def engine_calls(comm: tcoll.Communicator) -> int:
    """How many of 50 small blocking sends and receives (a ping-pong) went through the engine's isend/irecv."""
    counted = _count_engine_posts(comm)
    buf = np.zeros(4, dtype=np.int32)
    for i in range(50):
        if comm.rank == 0:
            comm.send(buf + i, 1, 5)
            comm.recv(buf, 1, 5)
        else:
            comm.recv(buf, 0, 5)
            comm.send(buf, 0, 5)
    return counted[0]


@needs_kernel
@pytest.mark.timeout(60)
def test_the_lean_path_serves_blocking_calls_unless_turned_off() -> None:
    taken = spawn_as("shm", engine_calls, 2, shm_kernel="auto", **LEAN)
    assert max(taken) <= 25, taken  # most go lean; a receive whose message comes after the lean spin does not
    assert spawn_as("shm", engine_calls, 2, shm_kernel="off", **LEAN) == [100, 100]


BUFFER_KINDS = ["numpy-bfloat16", "torch", "torch-bfloat16", "torch-requires-grad"]


def _buffer(kind: str, value: int):
    """Four elements equal to `value`, of `kind` (what a user may pass to send and recv)."""
    if kind.startswith("torch"):
        import torch

        dtype = torch.bfloat16 if kind == "torch-bfloat16" else torch.float32
        return torch.full((4,), float(value), dtype=dtype, requires_grad=kind == "torch-requires-grad")
    return np.full(4, value, dtype=BFLOAT16)


def _values(buf) -> list[float]:
    return [float(v) for v in (buf.detach().float() if hasattr(buf, "detach") else buf.astype(np.float64))]


def burst_calls(comm: tcoll.Communicator, kind: str, count: int) -> tuple[int, bool]:
    """Rank 0 sends `count` buffers of `kind`, rank 1 receives them once all are in its ring, then the other
    way: how many sends and receives went through the engine's isend/irecv, and whether all arrived right."""
    engine, counted = comm.core.engine, _count_engine_posts(comm)
    peer, buf, right = 1 - comm.rank, _buffer(kind, -1), True
    inbound = engine.channels[peer]._in
    for sender in (0, 1):
        if comm.rank == sender:
            for i in range(count):
                comm.send(_buffer(kind, i), peer, 5)
        else:
            while inbound.ctl[layout.HEAD] - inbound.ctl[layout.TAIL] < count * (HEADER.size + buf.nbytes):
                pass  # every message is in the ring: each receive finds its message at once
            for i in range(count):
                right &= _values(comm.recv(buf, peer, 5)) == [i] * 4
    return counted[0], right


@needs_kernel
@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", BUFFER_KINDS)
def test_tensors_and_bfloat16_arrays_go_lean_as_views_of_their_memory(kind: str) -> None:
    """A CPU tensor or bfloat16 array is sent and received through the kernel, byte for byte."""
    if kind.startswith("torch"):
        pytest.importorskip("torch")
    assert spawn_as("shm", burst_calls, 2, kind, 40, shm_kernel="auto", **LEAN) == [(0, True), (0, True)]
    assert spawn_as("shm", burst_calls, 2, kind, 40, shm_kernel="off", **LEAN) == [(80, True), (80, True)]


class Interrupted(Exception):
    """Stands in for a KeyboardInterrupt or a signal handler's exception."""


class RaisingRings:
    """The ring kernel of a channel, raising right after every call that moved a message (as a signal
    handler may, between the C call's return and the next Python statement)."""

    def __init__(self, rings) -> None:
        self.rings = rings

    def send(self, *args):
        if self.rings.send(*args) >= 0:
            raise Interrupted("after a send")
        return kernel.NO_ROOM

    def recv(self, *args):
        if self.rings.recv(*args) >= 0:
            raise Interrupted("after a receive")
        return kernel.NOTHING_YET


def interrupted_calls(comm: tcoll.Communicator, count: int) -> bool:
    """Every lean send and receive of rank 0 is interrupted after it moved its message: the stream stays
    whole (the positions live only in the rings), and the messages after it all arrive, in order."""
    peer = 1 - comm.rank
    if comm.rank == 0:
        channel = comm.core.engine.lean[peer]
        channel._rings = RaisingRings(channel._rings)
        for i in range(count):
            with pytest.raises(Interrupted):
                comm.send(np.full(3, i), peer, 1)
        out = np.zeros(3, dtype=np.int64)
        for i in range(count):
            got = None
            while got is None:
                try:
                    got = comm.recv(out, peer, 2)
                except Interrupted:  # the message was taken all the same
                    got = out
            assert (got == 100 + i).all(), (i, got)
        channel._rings = channel._rings.rings
        comm.send(np.full(3, -1), peer, 1)
        return True
    out = np.zeros(3, dtype=np.int64)
    for i in range(count):
        assert (comm.recv(out, peer, 1) == i).all(), (i, out)
        comm.send(np.full(3, 100 + i), peer, 2)
    return bool((comm.recv(out, peer, 1) == -1).all())


@needs_kernel
@pytest.mark.timeout(60)
def test_an_exception_right_after_a_lean_call_leaves_the_stream_whole() -> None:
    assert spawn_as("shm", interrupted_calls, 2, 40, shm_kernel="auto", **LEAN) == [True, True]


def threads_on_one_engine(comm: tcoll.Communicator, count: int) -> bool:
    """Two threads of each rank ping-pong on their own tags at once: lean calls and engine waits interleave."""
    import threading

    failures: list[BaseException] = []

    def pingpong(tag: int) -> None:
        try:
            buf = np.zeros(1 + tag * 40, dtype=np.int64)
            for i in range(count):
                if comm.rank == 0:
                    buf[:] = i * tag
                    comm.send(buf, 1, tag)
                    comm.recv(buf, 1, tag)
                    assert (buf == i * tag + 1).all(), (tag, i)
                else:
                    comm.recv(buf, 0, tag)
                    assert (buf == i * tag).all(), (tag, i)
                    buf += 1
                    comm.send(buf, 0, tag)
        except BaseException as exc:  # reported below, from the rank's own thread
            failures.append(exc)

    workers = [threading.Thread(target=pingpong, args=(tag,)) for tag in (1, 2)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    if failures:
        raise failures[0]
    return True


@pytest.mark.timeout(90)
@pytest.mark.parametrize("shm_kernel", KERNELS)
def test_threads_of_a_rank_share_the_lean_path_and_the_engine(shm_kernel: str) -> None:
    assert spawn_as("shm", threads_on_one_engine, 2, 400, shm_kernel=shm_kernel, **LEAN) == [True, True]


def sendrecv_ring(comm: tcoll.Communicator, rounds: int) -> bool:
    """Every rank sendrecvs right and left, small messages through the lean send; a bad receive buffer
    raises before anything is sent (the next round's message is the one received)."""
    r, p = comm.rank, comm.size
    right, left = (r + 1) % p, (r - 1) % p
    with pytest.raises(ValueError, match="read-only"):
        comm.sendrecv(np.full(4, r, dtype=np.int64), right, np.frombuffer(bytes(32), dtype=np.int64), left)
    for i in range(rounds):
        n = 1 + (i * 97) % 700
        out = np.zeros(n, dtype=np.int64)
        assert comm.sendrecv(np.full(n, r * 1000 + i, dtype=np.int64), right, out, left) is out  # tag 0, too
        assert (out == left * 1000 + i).all(), (i, out[:3])
    return True


@pytest.mark.timeout(60)
@pytest.mark.parametrize("shm_kernel", KERNELS)
def test_sendrecv_rings_send_at_once_and_refuse_bad_buffers_first(shm_kernel: str) -> None:
    assert spawn_as("shm", sendrecv_ring, 3, 300, shm_kernel=shm_kernel, **LEAN) == [True, True, True]
