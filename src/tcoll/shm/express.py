"""The express path: a repeated blocking call on the same arrays, whole, in one C call.

The calls it takes: all_reduce, reduce, broadcast and barrier on one array, and
the block collectives (all_gather, gather, all_to_all, reduce_scatter) from one
input into one output, and a scatter (tcoll.shm.described: root's chunks, the
others' `out`), each where the arena's kernel runs the call's steps.

An ordinary blocking call on a small array is its arena step (half a
microsecond on two ranks) inside about two microseconds of Python: checks,
numbering, the agreement's bookkeeping, the choice of path. The lean path
(tcoll.comm.plans) already skips the checks for a buffer seen before; the
express path skips the rest. Once a call on an array has run in Python, it is
bound into an `Express` (express.h, in the arena's C kernel): the next call on
that array runs the whole call in C and does, on success, what the Python
path records (the sequence number, the arena's steps, the last call for the
hang report, the agreement's ring of recent calls).

It runs only while the communicator's *gate* is open. The agreement shuts it
whenever something is pending that the next call must look at in Python (an
alarm, a notice, a revoke, a failed call, a call that only sent); the
dispatcher shuts it when the communicator closes, a plan is captured or the
arena is retired, and opens it again at the end of a call that ran in Python
and found nothing pending (Dispatcher.open_gate). The express call also checks
for itself that the array is the same object, with the same dtype, address
and length, still writable, and that no message or notice waits. When it
cannot finish (a peer later than its spin, descriptors that differ), it shuts
the gate, leaves where it got to in `arena.pending` and returns HANDED_OVER:
the Python path takes the same call over from there (Dispatcher.resume), with
its waiting, liveness checks and errors. If an exception (KeyboardInterrupt)
comes between the two, the call was begun and not finished here: this rank's
next call fails it as a call that failed here (the others are told, the
arena is renewed), never pairs with it.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .kernel_abi import KERNEL_DTYPES, kernel_module

__all__ = ["HANDED_OVER", "NO_RESULT", "NOTHING", "new_gate", "build", "stale", "forget_all"]

# What an express call returns when it began the call and the Python path must go on with it.
HANDED_OVER = kernel_module.HANDED_OVER if kernel_module is not None else object()

_COLLECTIVES = ("all_reduce", "reduce", "broadcast", "barrier")
_BLOCKS = {"all_gather": "ALL_GATHER", "gather": "GATHER", "all_to_all": "ALL_TO_ALL",
           "reduce_scatter": "REDUCE_SCATTER"}
# What an express gather returns on its other ranks, where the call's result is None (None from an express
# call means it did not run): the callers (tcoll.comm.plans) return None for it.
NO_RESULT = object()
NOTHING = np.empty(0, dtype=np.uint8)  # a barrier's buffer: a broadcast of no bytes (its step in the C kernel)


class _ShutGate:
    """The gate where the C kernel is not built: always shut (no express call is ever made)."""

    is_open = False

    def open(self, kernel: Any) -> bool:  # pragma: no cover - only without the C kernel
        return False

    def shut(self) -> None:
        pass


def new_gate(early: dict[Any, Any], ahead: dict[Any, Any]) -> Any:
    """A communicator's gate, shut; it stays shut while `early` (the watch's) or `ahead` (the agreement's) is not empty.

    Args:
        early: messages that came before their call (tcoll.p2p.watch.BlockWatch.early).
        ahead: notices for calls not started yet (tcoll.comm.agreement.Agreement._ahead).
    """
    if kernel_module is None:  # pragma: no cover - built without the C kernel
        return _ShutGate()
    return kernel_module.Gate(early, ahead)


def stale(prepared: Any) -> bool:
    """Whether an express call made for `prepared` expects what its call no longer does: a scatter's other rank
    whose `out` matched another description of root's since (its resolver's `accepted` moved past `bound`)."""
    call = prepared.call
    if call.collective != "scatter_described":
        return False
    resolve = call.args[2]
    return resolve is not None and resolve.accepted != resolve.bound


def forget_all() -> None:
    """Stop every express call made so far (a setting that decides a call's steps changed); new ones follow."""
    if kernel_module is not None:
        kernel_module.forget_all()


def build(dispatcher: Any, prepared: Any, x: Any) -> Any:
    """The express call of `prepared` (a tcoll.comm.calls.Prepared: a blocking call on array `x` that just ran
    well in Python), or None.

    Only an all_reduce or reduce that runs on the arena's one-step or split kernel takes it (a
    NumPy array that is the call's own buffer, a built-in op the kernel reduces in the array's
    dtype, a result that needs no finishing: avg divides, Python does; at most one slot; an all_reduce's
    buffer not lent: tcoll.shm.large.in_place_bytes), or a
    broadcast of such an array in the kernel's one step (where root's buffer is not lent); the block
    collectives and scatter have their own conditions (_build_blocks, _build_scatter).

    Returns:
        A kernel_module.Express: `run(x)` gives the call's result, or None when the Python path must run
        it (see express.h); `usable(kernel)` says whether it still runs on the arena's kernel.
    """
    # (imported here: importing tcoll.shm.vector registers its algorithms, which tcoll.algos does in its order)
    from .bridge import kernel_codes
    from .arena import ZERO_COPY_BYTES
    from .bridge import may_fail
    from .large import in_place_bytes
    from .vector import one_step

    call = prepared.call
    arena = dispatcher.arena
    if call.collective in _BLOCKS:
        return _build_blocks(dispatcher, prepared, x)
    if call.collective == "scatter_described":
        return _build_scatter(dispatcher, prepared, x)
    if (not _in_arena_kernel(arena, prepared, x) or call.collective not in _COLLECTIVES or prepared.finishes
            or call.copies or call.staged is not None):
        return None
    flat = call.args[0] if call.args else x  # (a barrier's token: no bytes)
    if flat.nbytes != x.nbytes or flat.nbytes > arena.slot_bytes or \
            flat.__array_interface__["data"][0] != x.__array_interface__["data"][0]:
        return None
    lending = False
    if call.collective in ("broadcast", "barrier"):  # one step, as tcoll.shm.vector takes it in the kernel
        root = call.root if call.collective == "broadcast" else 0  # (a barrier: a broadcast of no bytes)
        lending = flat.nbytes >= ZERO_COPY_BYTES  # (a root that lends its buffer takes the Python steps)
        if lending and dispatcher.rank == root and arena.lend(flat.view(np.uint8), flat.nbytes) is not None:
            return None
        codes, want, split = (KERNEL_DTYPES[np.dtype(np.uint8)], 0), dispatcher.rank != root, False
    else:
        op = call.args[1]
        codes = None if may_fail(op) else kernel_codes(arena, flat.dtype, op)
        if codes is None:
            return None
        want, split, root = call.collective == "all_reduce" or dispatcher.rank == call.root, \
            not one_step(flat.nbytes, arena), -1
        if call.collective == "all_reduce" and split and flat.nbytes >= in_place_bytes(arena) and \
                arena.lend(flat.view(np.uint8), flat.nbytes) is not None:
            return None  # (it lends its buffer: Python's steps, in place where every rank lends)
    agreement = dispatcher.agreement
    return kernel_module.Express(
        agreement.gate, arena.kernel, x, call.result, arena, dispatcher, agreement.watch, prepared,
        agreement.ring_sequences, agreement.ring_calls, call.label, prepared.stamp, codes[0], codes[1], want,
        split, arena.kernel_spin_ns, arena.kernel_yields, root, -1, None, 0, lending, None)


def _in_arena_kernel(arena: Any, prepared: Any, x: Any) -> bool:
    """Whether blocking `prepared` (on NumPy array `x`) runs on an arena of 2 or more ranks with the C kernel, by
    the shm direct algorithm: what every express call needs first."""
    info = prepared.info
    return (kernel_module is not None and arena is not None and type(arena.kernel) is kernel_module.Kernel
            and arena.size >= 2 and info is not None and info.direct and info.name == "shm"
            and not prepared.async_op and type(x) is np.ndarray)


def _build_blocks(dispatcher: Any, prepared: Any, x: Any) -> Any:
    """The express call of a blocking all_gather, gather, all_to_all or reduce_scatter on array `x` into a fixed
    output (the caller's `out`, or a plan's; none on a gather's other ranks), or None.

    Only a call the arena's kernel runs in one step (tcoll.shm.blocks._in_kernel) takes it, reading `x` itself
    (not a copy of it: an input that overlaps the output is copied at every call), with a built-in op the
    kernel reduces in x's dtype and no finishing (avg divides, Python does) for a reduce_scatter.
    """
    from .arena import ZERO_COPY_BYTES
    from .blocks import _share, _steps
    from .lending import by_address
    from .bridge import kernel_codes, may_fail

    call = prepared.call
    arena = dispatcher.arena
    if not _in_arena_kernel(arena, prepared, x) or prepared.finishes:
        return None
    collective, size = call.collective, arena.size
    root = call.root if collective == "gather" else 0  # (a reduce_scatterv's root field is a digest)
    result, out = call.result, call.result
    if collective in ("all_gather", "gather"):
        send = call.staged[1] if collective == "all_gather" else call.args[0]
        block, share, codes = send.nbytes, arena.slot_bytes, (KERNEL_DTYPES[np.dtype(np.uint8)], 0)
        if collective == "gather" and dispatcher.rank != root:
            result, out = NO_RESULT, None  # (nothing comes back on the other ranks)
    else:
        send = call.args[0]
        block = send.nbytes // size
        if collective == "all_to_all":
            share, codes = _share(arena), (KERNEL_DTYPES[np.dtype(np.uint8)], 0)
        else:
            op = call.args[3]
            share = _share(arena, send.itemsize)
            codes = None if may_fail(op) else kernel_codes(arena, send.dtype, op)
        if codes is None or len(set(call.args[2])) != 1:
            return None
    if collective in ("all_gather", "all_to_all") and by_address(arena, block * size):
        return None  # (every rank reads the others' blocks where they lie: lending.read_lent)
    lending = collective != "all_gather" and block * size >= ZERO_COPY_BYTES  # (see blocks._in_kernel)
    if lending and arena.lend(send.reshape(-1).view(np.uint8), block * size) is not None:
        return None
    if (send.nbytes != x.nbytes or send.__array_interface__["data"][0] != x.__array_interface__["data"][0]
            or _steps([block], share) != 1 or not (isinstance(out, np.ndarray) or result is NO_RESULT)):
        return None
    agreement = dispatcher.agreement
    return kernel_module.Express(
        agreement.gate, arena.kernel, x, result, arena, dispatcher, agreement.watch, prepared,
        agreement.ring_sequences, agreement.ring_calls, call.label, prepared.stamp, codes[0], codes[1], False,
        False, arena.kernel_spin_ns, arena.kernel_yields, root, getattr(kernel_module, "BLOCKS_" + _BLOCKS[collective]),
        out, block, lending, None)


def _build_scatter(dispatcher: Any, prepared: Any, x: Any) -> Any:
    """The express call of a blocking scatter (tcoll.shm.described) whose chunks fit its first step, or None:
    on root, from `x` (its chunks, not lent) into its own chunk's output; elsewhere into `x` (the caller's out),
    while root's description is the one the last call checked (its resolver's `accepted`)."""
    from .described import DESCRIPTION_BYTES, first_share

    call = prepared.call
    arena = dispatcher.arena
    if not _in_arena_kernel(arena, prepared, x):
        return None
    send, header, resolve, root, own = call.args
    size = arena.size
    if send is not None:  # root: its own chunk goes to the call's output too
        out = own[0]
        block = send.nbytes // size
        if (arena.lend(send, send.nbytes) is not None or x.nbytes != send.nbytes
                or x.__array_interface__["data"][0] != send.__array_interface__["data"][0]):
            return None
    else:  # (a plan's x is its first argument, the chunks, which the other ranks ignore: no express call then)
        if x is not getattr(resolve, "out", None):
            return None
        out, header = x, resolve.accepted
        block = x.nbytes
        resolve.bound = header
    if (header is None or len(header) != DESCRIPTION_BYTES or not isinstance(out, np.ndarray)
            or block > first_share(arena.slot_bytes, size, DESCRIPTION_BYTES)):
        return None
    agreement = dispatcher.agreement
    return kernel_module.Express(
        agreement.gate, arena.kernel, x, call.result, arena, dispatcher, agreement.watch, prepared,
        agreement.ring_sequences, agreement.ring_calls, call.label, prepared.stamp, KERNEL_DTYPES[np.dtype(np.uint8)],
        0, False, False, arena.kernel_spin_ns, arena.kernel_yields, root, kernel_module.BLOCKS_SCATTER,
        out, block, False, header)
