"""The Communicator: the ranks of a job and the operations between them."""

from __future__ import annotations

import atexit
import logging
import os
import sys
import threading
from typing import Any

import numpy as np

from ..buffers import as_bytes, exported
from ..errors import TcollError
from ..p2p.engine import Engine
from ..p2p.work import Work
from ..shm.heap import heap_of
from ..transport.base import Transport
from . import groups, movement, objects, pairs, parcels, plans, prefix, reductions, staging, survival, uneven
from .checks import MAX_TAG, check_peer, check_tag
from .core import CommCore
from .dispatch import Dispatcher

__all__ = ["Communicator", "MAX_TAG"]

_LEAVE_TIMEOUT = 10.0  # seconds the store's host waits at close for the others to let go of it
# Seconds a rank whose last call only sent waits at close for its peers to close (what shows a disagreement
# may be on its way). Short: two such ranks (the senders of a gather) wait for each other, each closing only
# once its own wait ends, so every exit after such a call costs this much on them.
_LINGER = 1.0


class Communicator:
    """A group of ranks that exchange messages.

    Made by `tcoll.init()` (or `tcoll.spawn`), or from another communicator
    by `split`, `group`, `dup` or `create_group`; not directly. Point-to-point
    operations take NumPy arrays, PyTorch CPU tensors, or other contiguous
    buffers; receives land in place, without an extra copy. The collectives
    are written in tcoll.comm.reductions, movement, uneven and objects, and
    run through the communicator's dispatcher (tcoll.comm.dispatch).

    Attributes:
        rank: this process's rank, 0 <= rank < size.
        size: the number of ranks.
        run_id: the job's name, shared by its ranks.
        core: what tcoll's own modules use of it (tcoll.comm.core.CommCore: engine, dispatcher,
            world ranks, contexts); not for users.
    """

    # The collectives, written as functions of the communicator in their own modules.
    all_reduce = reductions.all_reduce
    reduce = reductions.reduce
    reduce_scatter = reductions.reduce_scatter
    reduce_scatterv = reductions.reduce_scatterv
    barrier = reductions.barrier
    scan = prefix.scan
    exscan = prefix.exscan
    scan_object = prefix.scan_object
    exscan_object = prefix.exscan_object
    broadcast = movement.broadcast
    all_gather = movement.all_gather
    gather = movement.gather
    scatter = movement.scatter
    all_to_all = movement.all_to_all
    all_gatherv = uneven.all_gatherv
    gatherv = uneven.gatherv
    scatterv = uneven.scatterv
    all_to_allv = uneven.all_to_allv
    broadcast_object = objects.broadcast_object
    all_gather_object = objects.all_gather_object
    gather_object = objects.gather_object
    scatter_object = objects.scatter_object
    all_to_all_object = objects.all_to_all_object
    send_object = parcels.send_object
    recv_object = parcels.recv_object
    isend_object = parcels.isend_object
    irecv_object = parcels.irecv_object
    sendrecv_object = parcels.sendrecv_object
    sendrecv = pairs.sendrecv
    sendrecv_replace = pairs.sendrecv_replace
    probe = pairs.probe
    iprobe = pairs.iprobe
    # Persistent forms (tcoll.comm.plans): the same arguments, checked and bound once; a Plan back.
    all_reduce_init = plans.initializer(reductions.all_reduce)
    reduce_init = plans.initializer(reductions.reduce)
    reduce_scatter_init = plans.initializer(reductions.reduce_scatter)
    reduce_scatterv_init = plans.initializer(reductions.reduce_scatterv)
    barrier_init = plans.initializer(reductions.barrier)
    broadcast_init = plans.initializer(movement.broadcast)
    all_gather_init = plans.initializer(movement.all_gather)
    gather_init = plans.initializer(movement.gather)
    scatter_init = plans.initializer(movement.scatter)
    all_to_all_init = plans.initializer(movement.all_to_all)
    all_gatherv_init = plans.initializer(uneven.all_gatherv)
    gatherv_init = plans.initializer(uneven.gatherv)
    scatterv_init = plans.initializer(uneven.scatterv)
    all_to_allv_init = plans.initializer(uneven.all_to_allv)
    broadcast_object_init = plans.initializer(objects.broadcast_object)
    all_gather_object_init = plans.initializer(objects.all_gather_object)
    gather_object_init = plans.initializer(objects.gather_object)
    scatter_object_init = plans.initializer(objects.scatter_object)
    scan_init = plans.initializer(prefix.scan)
    exscan_init = plans.initializer(prefix.exscan)
    # Going on without a dead rank (tcoll.comm.survival, after MPI's ULFM).
    failed = survival.failed
    revoke = survival.revoke
    agree = survival.agree
    shrink = survival.shrink
    split = groups.split
    group = groups.group
    dup = groups.dup
    create_group = groups.create_group
    split_type = groups.split_type
    leaders = groups.leaders
    hosts = property(groups.hosts)

    def __init__(self, engine: Engine, transports: list[Transport], run_id: str, *,
                 world_ranks: list[int] | None = None, context: int = 0, parent: Communicator | None = None,
                 replaces: bool = False) -> None:
        world = list(range(engine.size)) if world_ranks is None else world_ranks
        self.run_id = run_id
        self.rank = world.index(engine.rank)
        self.size = len(world)
        self._store: Any = None
        self._parent = parent
        self._replaces = replaces  # made by shrink: closing it closes the parent, which it replaced
        # Every communicator has its own context: its point-to-point messages
        # travel in engine context 2c and its collectives in 2c + 1, so no
        # message of one communicator can match a receive of another.
        dispatch = Dispatcher(engine, world, 2 * context + 1, run_id, engine.settings.timeout)
        self.core = CommCore(engine, dispatch, world, 2 * context, transports)
        self.core.survival = survival.Survival(self.core)
        staging.install_once(type(self), engine.settings.gpu)  # CUDA buffers in every call, where a GPU may be
        self._close_lock = threading.Lock()

    @property
    def timeout(self) -> float:
        """Seconds a blocking call of this communicator may take (settable; an async Work's wait takes its own)."""
        return self.core.dispatch.timeout

    @timeout.setter
    def timeout(self, seconds: float) -> None:
        self.core.dispatch.timeout = float(seconds)

    @property
    def world_ranks(self) -> list[int]:
        """The world rank of each rank of this communicator."""
        return list(self.core.world)

    # -- point-to-point ----------------------------------------------------------

    def isend(self, buf: Any, dst: int, tag: int = 0) -> Work:
        """Start sending `buf` to rank `dst`; returns a Work to wait on.

        The buffer must not be modified until the Work completes. Messages from
        one rank to another with the same tag arrive in the order they were sent.

        Args:
            buf: a contiguous NumPy array, PyTorch CPU tensor, or buffer-protocol object.
            dst: the destination rank.
            tag: a non-negative integer that the receive must name too.

        Returns:
            A Work; wait() returns `buf`.

        Raises:
            ValueError: `dst` out of range, bad tag, or a non-contiguous buffer.
            TypeError: `buf` is not a buffer.
            PeerLostError: `dst` is known to be gone.
        """
        core = self.core
        core.check_open()
        check_peer(dst, self.size, "dst")
        check_tag(tag)
        data = as_bytes(buf, writable=False, what="send buffer")
        return core.engine.isend(data, core.world[dst], core.p2p_ctx, tag, buf)

    def irecv(self, buf: Any, src: int, tag: int = 0) -> Work:
        """Start receiving a message from rank `src` into `buf`; returns a Work.

        The message may be shorter than the buffer (as in MPI); a longer one
        fails the receive with MessageSizeError and is discarded.

        Args:
            buf: a writable contiguous NumPy array, PyTorch CPU tensor, or buffer.
            src: the source rank, or tcoll.ANY_SOURCE.
            tag: the tag the sender used, or tcoll.ANY_TAG.

        Returns:
            A Work; wait() returns `buf`. Once complete, its `source`, `tag` and
            `nbytes` tell who sent the message, on which tag, and its size.

        Raises:
            ValueError: `src` out of range, bad tag, or a non-contiguous or read-only buffer.
            TypeError: `buf` is not a buffer.
            PeerLostError: `src` is known to be gone.
        """
        core = self.core
        core.check_open()
        peer = pairs.source_of(self, src, tag)
        data = as_bytes(buf, writable=True, what="receive buffer")
        work = core.engine.irecv(data, peer, core.p2p_ctx, tag, buf)
        work.ranks = core.world
        return work

    def send(self, buf: Any, dst: int, tag: int = 0, timeout: float | None = None) -> None:
        """Send `buf` to rank `dst` and wait until the buffer may be reused (see isend).

        Between ranks of one host a small message is written straight into the peer's ring when nothing
        is queued before it (the lean path, with no Work); anything else goes through isend.
        """
        core = self.core
        if (type(dst) is int and type(tag) is int and 0 <= dst < self.size and 0 <= tag <= MAX_TAG
                and core.usable):
            engine, peer, ctx = core.engine, core.world[dst], core.p2p_ctx
            # a buffer that exports its memory goes as it is; a tensor or bfloat16 array as a view of its memory
            if engine.send_now(buf, peer, ctx, tag) or (engine.lean[peer] is not None
                                                        and (view := exported(buf)) is not buf
                                                        and engine.send_now(view, peer, ctx, tag)):
                return
        self.isend(buf, dst, tag).wait(self.timeout if timeout is None else timeout)
        if not core.usable:  # revoked while it waited: its peer drained the bytes without receiving them
            core.check_open()

    def recv(self, buf: Any, src: int, tag: int = 0, timeout: float | None = None) -> Any:
        """Receive a message from rank `src` into `buf` and return `buf` (see irecv).

        If it times out before the message started to arrive, the receive is
        withdrawn, so the message goes to the next receive instead. Between
        ranks of one host, when nothing else could claim the message, it is
        taken straight from the ring (the lean path, with no Work).
        """
        core = self.core
        if (type(src) is int and type(tag) is int and 0 <= src < self.size and 0 <= tag <= MAX_TAG
                and core.usable):
            engine, peer, ctx = core.engine, core.world[src], core.p2p_ctx
            # the kernel refuses a tensor before it polls; it then takes a view of the tensor's memory
            if engine.recv_now(buf, peer, ctx, tag) or (engine.lean[peer] is not None
                                                        and (view := exported(buf)) is not buf
                                                        and engine.recv_now(view, peer, ctx, tag)):
                return buf
        work = self.irecv(buf, src, tag)
        try:
            return work.wait(self.timeout if timeout is None else timeout)
        except BaseException:  # a timeout, or KeyboardInterrupt: nobody will wait for it again
            work.cancel()
            raise

    # -- zero-copy buffers -----------------------------------------------------------

    def empty(self, shape: int | tuple[int, ...], dtype: Any = np.float64) -> np.ndarray:
        """A new NumPy array in shared memory, for collectives that skip the copy into the arena.

        When every rank of the communicator shares this host, the shared-memory
        collectives read such a buffer where it lies instead of copying it in
        first (the counterpart of NCCL's buffer registration, with nothing to
        register). Anywhere else it is an ordinary array. `torch.from_numpy`
        turns it into a tensor on the same memory. Its file in /dev/shm is
        removed when the last array on it goes (or when the world
        communicator closes); the memory itself lives as long as arrays on it
        do (here, and in the other ranks that read it).

        Args:
            shape: the array's shape.
            dtype: its NumPy dtype.

        Returns:
            A writable C-contiguous array; its contents are zero.

        Raises:
            TransportError: /dev/shm has no room for it.
        """
        dtype = np.dtype(dtype)
        shape = (shape,) if isinstance(shape, (int, np.integer)) else tuple(int(n) for n in shape)
        if any(n < 0 for n in shape):
            raise ValueError(f"negative dimensions are not allowed: {shape}")
        self.core.check_open()
        if not self.core.dispatch.direct_capable():
            return np.zeros(shape, dtype)
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        return heap_of(self.core.engine, self.run_id).allocate(nbytes).view(dtype).reshape(shape)

    def zeros(self, shape: int | tuple[int, ...], dtype: Any = np.float64) -> np.ndarray:
        """A new zero-filled NumPy array in shared memory (see `empty`)."""
        return self.empty(shape, dtype)

    # -- introspection and life cycle -------------------------------------------

    def transport(self, peer: int) -> str:
        """The name of the transport that carries messages to `peer` ("shm", "tcp", ...)."""
        check_peer(peer, self.size, "peer")
        return self.core.engine.transport_of(self.core.world[peer])

    def own_store(self, store: Any) -> None:
        """Close `store` with this communicator (init() opened it for this communicator)."""
        self._store = store

    @property
    def closed(self) -> bool:
        """Whether close() (of this communicator, or of the world it came from) has been called."""
        return self.core.closed or self.core.engine.closed

    def close(self, *, linger: bool = True) -> None:
        """Release channels, shared memory and sockets; pending operations fail.

        Not collective: each rank closes its own side. Idempotent. Closing a
        sub-communicator (from split, group or dup) only marks it closed:
        its channels belong to the world it came from; its pending receives
        fail, and what its peers still send on it is drained and dropped. Closing the communicator
        that shrink() made closes the one it replaced too (the world's: all).

        A disagreement that showed only after the last call it concerns (a late
        message, another rank's notice) is raised here, once all is released. A
        rank whose last call only sent (the root of a point-to-point broadcast)
        first waits until its peers have closed too (at most 1 s, or the
        timeout if shorter), so that what they sent on that call is in.

        Args:
            linger: False: neither wait for the peers nor raise what showed late (an abort, a cleanup after
                another error, leaving a `with` block by an exception: that error is the one to see).

        Raises:
            MismatchError, PeerFailedError: the ranks disagreed on a call and this rank had not said so yet.
        """
        core = self.core
        with self._close_lock:
            if core.closed:
                return
            core.closed = True
            core.usable = False
        # A sub-communicator's arena goes with it, not with the world.
        wait = min(self.timeout, _LINGER) if self._parent is None and linger else 0.0
        found = core.dispatch.close(wait)
        if self._parent is not None and not core.engine.closed:  # what still comes for it is dropped, not kept
            gone = TcollError("the communicator is closed")
            for ctx in (core.p2p_ctx, parcels.parts_context(core.p2p_ctx), core.dispatch.ctx):
                core.engine.withdraw(ctx, gone)
        if self._parent is None:
            core.engine.close()
            for transport in core.transports:
                transport.close()
            if self._store is not None:
                self._leave_store()
                self._store.close()
            _forget(self)
        if self._replaces and self._parent is not None:
            self._parent.close(linger=False)
        if found is not None and linger:
            raise found

    def _leave_store(self) -> None:
        """Let the rank whose process serves the store close it last.

        The others say goodbye; the host waits for the goodbyes of the ranks
        not known to be lost, so its server never vanishes under a rank whose
        last request is still on the wire.
        """
        try:
            if getattr(self._store, "server", None) is None:
                self._store.set(f"leave/{self.rank}", b"1")
                return
            alive = [r for r in range(self.size) if r != self.rank and not self.core.engine.is_lost(r)]
            self._store.wait([f"leave/{r}" for r in alive], min(self.timeout, _LEAVE_TIMEOUT))
        except (TcollError, OSError):
            pass  # a rank that died without being noticed never says goodbye; closing goes on

    def __enter__(self) -> Communicator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close(linger=exc[0] is None)  # leaving by an exception: that one is what the user sees

    def __repr__(self) -> str:
        return f"<tcoll.Communicator rank {self.rank} of {self.size}{' (closed)' if self.closed else ''}>"


_live: set[Communicator] = set()
_live_lock = threading.Lock()


def track(comm: Communicator) -> Communicator:
    """Remember a communicator so that it is closed at interpreter exit."""
    with _live_lock:
        _live.add(comm)
    return comm


def _forget(comm: Communicator) -> None:
    with _live_lock:
        _live.discard(comm)
    for hook in _on_close:
        hook(comm)


_on_close: list[Any] = []  # called with each communicator as it closes (world forgets its default)


def on_close(hook: Any) -> None:
    """Call hook(comm) with each communicator as it closes, from now on.

    Args:
        hook: a callable taking the communicator; startup uses it to forget a closed default.
    """
    _on_close.append(hook)


@atexit.register
def _close_all() -> None:
    with _live_lock:
        comms = list(_live)
    found = []
    for comm in comms:
        try:
            comm.close()
        except TcollError as exc:  # the ranks disagreed, and only now does it show
            found.append(f"tcoll: rank {comm.rank}: {type(exc).__name__}: {exc}")
        except Exception:  # noqa: BLE001 - best effort at exit
            pass
    if found:  # the job must not end well: an exception here would not change the exit status
        print("\n".join(found), file=sys.stderr, flush=True)
        sys.stdout.flush()
        logging.shutdown()  # (os._exit skips the exit handlers registered before tcoll's: flush the logs)
        os._exit(1)

