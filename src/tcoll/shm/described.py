"""A scatter in one call on the arena: root's description of the chunks travels with them.

The other ranks of a scatter need not know what they receive (tcoll's
scatter takes no `out` there), so the portable scatter is a program: a
broadcast of root's description, then the scatter. On one host the
description rides in the head of root's slot in the scatter's first step
instead, the way all_to_allv's counts do (tcoll.shm.blocks): one call and
one agreement where the program takes two of each; a repeated call runs
whole in C (the arena kernel's step_scatter, through tcoll.shm.express).

Steps (every rank takes them, alike):

- first: root writes the description and the first share of every other
  rank's chunk (`first` bytes each, after the description) and publishes; the
  others publish at once; all agree (`Arena.agree`). Each other rank then
  reads the description (`resolve` checks it against its `out`, or makes the
  output: a MismatchError there is raised before it says it is done) and
  copies its share, or its whole chunk where root lent its buffer.
- more, while the chunks are larger than the first share: root writes a full
  share of each chunk (`slot_bytes // size` bytes); the others copy theirs.
- last (closing): every rank publishes that it read (or wrote) everything,
  and waits until every rank has taken root's description (has published
  the step after the first: in a call of one step, the closing one), so that
  a rank whose `out` did not match makes every rank's call fail (its notice
  comes). A call of many steps thus ends without waiting for the last copies
  out: the next call's first step waits for them before it writes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from ..algos.registry import Costs, algorithm
from ..algos.select import ARENA_COPY, ARENA_SYNC
from .arena import Arena
from .bridge import copy_bytes
from .kernel_abi import kernel_module

__all__ = ["DESCRIPTION_BYTES", "first_share", "scatter_described"]

NOT_STARTED, PUBLISHED, DONE, REDUCED = ((kernel_module.NOT_STARTED, kernel_module.PUBLISHED, kernel_module.DONE,
                                          kernel_module.REDUCED) if kernel_module is not None else (0, 1, 2, 3))
_STEPS_TAKEN = {PUBLISHED: 1, DONE: 2, REDUCED: 2}  # by the kernel's step_scatter, by how far it got
DESCRIPTION_BYTES = 256  # the description's width (tcoll.comm.describe.META_BYTES: a test checks they agree)


def first_share(slot_bytes: int, size: int, width: int) -> int:
    """Bytes of each chunk in the first step: what the slot holds after the description, split by rank."""
    return (slot_bytes - width) // size


def _cost(c: Costs, nbytes: int, size: int) -> float:
    # `nbytes`: one chunk. A step per slot's worth, and the closing one; on the longest chain root copies the
    # description and p-1 chunks in, a rank the description and its chunk out
    if size == 1:
        return 0.0
    steps = 2 + max(0, -(-(nbytes - (1 << 20) // size) // max(1, (1 << 20) // size)))
    return steps * ARENA_SYNC + (size * nbytes + 2 * DESCRIPTION_BYTES) * ARENA_COPY


@algorithm("scatter_described", "shm", cost=_cost, direct=True)
def scatter_described(arena: Arena, send: np.ndarray | None, header: np.ndarray | None,
                      resolve: Callable[[np.ndarray], np.ndarray] | None, root: int,
                      own: tuple[np.ndarray, np.ndarray] | None) -> None:
    """Shared-memory scatter in one call: root's description of the chunks heads its first step's slot.

    The steps are the module's docstring's.

    An express call of it (tcoll.shm.express, the kernel's step_scatter) that handed over leaves how far it
    got in `arena.pending`: the steps go on from there.

    Args:
        send: root's chunks, flat bytes (None elsewhere).
        header: root's description of one chunk, DESCRIPTION_BYTES long (None elsewhere).
        resolve: the other ranks' check of the description: given it (as root wrote it, read-only), it
            returns where this rank's chunk goes (flat bytes), or raises (MismatchError).
        root: the rank that holds the chunks.
        own: root's (output, own chunk), flat bytes, copied once the others' shares are out (None elsewhere,
            or nothing to copy).

    Raises:
        MismatchError: the ranks disagree on the call (every rank), or `resolve` raised (that rank; the
            others raise its notice).
    """
    if arena.size == 1:
        if own is not None:
            copy_bytes(arena, *own)
        return
    state = _in_kernel(arena, send, header, resolve, root, own)
    if state == DONE:
        return
    if arena.rank == root:
        assert send is not None and header is not None
        _send(arena, send, header, state, own)
    else:
        assert resolve is not None
        _receive(arena, resolve, root, state)


def _in_kernel(arena: Arena, send: np.ndarray | None, header: np.ndarray | None, resolve: Any, root: int,
               own: tuple[np.ndarray, np.ndarray] | None) -> int:
    """The state an express call of this call handed over in, or else the kernel's step_scatter where it takes
    the call: chunks that fit the first step, root's buffer not lent, and (the others) an `out` checked against
    the description root sends (`resolve.expected()`); NOT_STARTED where it does not (the recorder's arena, too)."""
    if arena.kernel is None:  # (no express call either)
        return NOT_STARTED
    if arena.pending:
        return arena.kernel_step(None, (), (), _STEPS_TAKEN)
    if send is not None:
        fits = send.size // arena.size <= _first_share(arena) and arena.lend(send, send.size) is None
        args = (send, None if own is None else own[0], header)
    else:
        expected = getattr(resolve, "expected", lambda: None)()
        fits = expected is not None and expected[1].size <= _first_share(arena)
        args = (None, expected[1], expected[0]) if fits else ()
    return arena.kernel_step("run_scatter", (*args, root), (), _STEPS_TAKEN) if fits else NOT_STARTED


def _send(arena: Arena, send: np.ndarray, header: np.ndarray, state: int,
          own: tuple[np.ndarray, np.ndarray] | None) -> None:
    """Root: the description and the chunks' shares, step by step (or its buffer lent), its own chunk (the others
    copy theirs meanwhile); then the closing step."""
    me, width = arena.rank, DESCRIPTION_BYTES
    block = send.size // arena.size
    if state == REDUCED:  # (the kernel's: the closing step published)
        arena.wait_all(arena.step - 1)
        return
    ref = arena.lend(send, send.size) if state == NOT_STARTED else None  # (the kernel lends nothing)
    first = arena.first_step(ref) if state == NOT_STARTED else arena.first
    share, piece = _first_share(arena), arena.slot_bytes // arena.size
    if state == NOT_STARTED and ref is None and arena.kernel is not None:  # streamed (as the steps after it)
        arena.kernel.scatter_write(send, first, 0, share, header)
    elif state == NOT_STARTED:  # (else the kernel wrote and published the first step)
        slot = arena.slot(me, first)
        slot[:width] = header[:width]
        if ref is None:
            _put(arena, slot, width, share, send, 0)
        arena.publish(first)
    arena.agree(first)
    lo = share
    while ref is None and lo < block:
        step = arena.claim()
        if arena.kernel is not None:  # streamed: each rank copies its share as it comes
            arena.kernel.scatter_write(send, step, lo, piece, None)
        else:
            _put(arena, arena.slot(me, step), 0, piece, send, lo)
            arena.publish(step)
        lo += piece
    if own is not None:
        copy_bytes(arena, *own)
    _close(arena, first)


def _first_share(arena: Arena) -> int:
    """Bytes of each chunk in the call's first step on `arena` (ValueError if none: the communicator's choice
    keeps such a slot off this algorithm)."""
    share = first_share(arena.slot_bytes, arena.size, DESCRIPTION_BYTES)
    if share <= 0:
        raise ValueError(f"scatter: the shared-memory slot ({arena.slot_bytes} B) cannot hold the chunks' "
                         f"description ({DESCRIPTION_BYTES} B) and a byte of each of {arena.size} ranks; "
                         "raise TCOLL_SHM_SLOT")
    return share


def _put(arena: Arena, slot: np.ndarray, base: int, piece: int, send: np.ndarray, lo: int) -> None:
    """Root: bytes [lo, lo + piece) of every other rank's chunk q into slot[base + q * piece:]."""
    block = send.size // arena.size
    hi = min(block, lo + piece)
    for q in range(arena.size if hi > lo else 0):
        if q != arena.rank:
            copy_bytes(arena, slot[base + q * piece:base + q * piece + hi - lo], send[q * block + lo:q * block + hi])


def _receive(arena: Arena, resolve: Callable[[np.ndarray], np.ndarray], root: int, state: int) -> None:
    """Not root: read root's description, then this rank's chunk, step by step (or from root's lent buffer)."""
    me, width = arena.rank, DESCRIPTION_BYTES
    if state == REDUCED:  # (the kernel's: the chunk copied, the closing step published)
        arena.wait_all(arena.step - 1)
        return
    share, piece = _first_share(arena), arena.slot_bytes // arena.size
    streamed = False
    if state == NOT_STARTED:
        first = arena.first_step()
        arena.publish(first)
        streamed = _first_streamed(arena, resolve, root, first, share)
    else:  # (the kernel's: the first step published)
        first = arena.first
    arena.agree(first)
    if streamed:
        out = resolve.expected()[1]  # type: ignore[attr-defined]
    else:
        header = np.asarray(arena.slot(root, first)[:width])  # (a view of root's slot)
        header.flags.writeable = False
        out = resolve(header)
    block = out.size
    source = arena.peer_buffer(first, root)
    if source is not None:
        copy_bytes(arena, out, source[me * block:(me + 1) * block])
        _close(arena, first)
        return
    if block and not streamed:
        at, hi = width + me * share, min(block, share)
        copy_bytes(arena, out[:hi], arena.slot(root, first)[at:at + hi])
    lo = share
    while lo < block:
        hi = min(block, lo + piece)
        step = arena.skip()
        arena.publish(step)
        if arena.kernel is None or not arena.kernel.scatter_read(out[lo:hi], root, step, me * piece,
                                                                 arena.kernel_spin_ns, arena.kernel_yields, None):
            arena.wait_rank(root, step)  # (root's stream did not come within the kernel's spin: copy it whole)
            copy_bytes(arena, out[lo:hi], arena.slot(root, step)[me * piece:me * piece + hi - lo])
        lo += piece
    _close(arena, first)


def _first_streamed(arena: Arena, resolve: Any, root: int, first: int, share: int) -> bool:
    """Whether this rank's share of the first step came streamed (the kernel's scatter_read): where its `out` was
    checked against a description before (`resolve.expected()`), once root wrote that one."""
    expected = getattr(resolve, "expected", lambda: None)() if arena.kernel is not None else None
    if expected is None:
        return False
    header, out = expected
    return bool(arena.kernel.scatter_read(out[:min(out.size, share)], root, first, DESCRIPTION_BYTES + arena.rank * share,
                                          arena.kernel_spin_ns, arena.kernel_yields, header))


def _close(arena: Arena, first: int) -> None:
    """The closing step: this rank read (or wrote) everything; wait until every rank has published the step
    after the call's `first`, which each other rank does once it took root's description: the closing step of
    a call of one step, else the second (a rank whose out does not fit never does). The next call's first step
    waits for every rank's closing one before anything is written again."""
    done = arena.skip()
    arena.publish(done)
    arena.wait_all(first + 1)
