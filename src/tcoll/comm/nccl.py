"""CUDA buffers on NCCL, under tcoll's control plane: every rank with its own GPU.

A collective on CUDA buffers runs on NCCL when the communicator's path is
"nccl" (TCOLL_GPU=nccl, or auto where every rank has a GPU of its own and can
load NCCL) and NCCL has the call: all_reduce, reduce, broadcast, all_gather,
reduce_scatter and all_to_all, with sum, prod, max, min (and avg on floating
types), on the dtypes NCCL has. Everything else (user ops, bitwise and logical
ops, named algorithms, scans, uneven and rooted gathers, point-to-point) goes
through host staging as on a shared GPU, so every call still works.

tcoll keeps the control plane:

- **the fingerprint first**: before anything is queued, the ranks compare
  the call's description (collective, op, dtype, count, root) in a small CPU
  all_reduce of tcoll's own (gathering the descriptions only where they
  differ, to name who); ranks that disagree, or whose NCCL failed
  earlier, raise MismatchError / PeerFailedError on every rank, and nothing
  reaches the GPU. A rank that never makes the call is named by tcoll's own
  hang report, as for any CPU call;
- **the unique id** is made by rank 0 and travels by tcoll's broadcast on the
  communicator at its first NCCL call (sub-communicators too);
- **the stream**: the NCCL call is queued on the caller's current stream (torch's,
  or CuPy's for a CuPy array), so it waits for the work before it and the work
  after it sees the result; a blocking call returns once queued, as NCCL's do;
- **the timeout**: a watchdog thread follows each queued call by an event; one
  not done within the communicator's timeout aborts the NCCL communicator
  (ncclCommAbort) and fails the call with tcoll.TimeoutError naming the call and
  the rank; an asynchronous NCCL error aborts it too (tcoll.comm.nccl_state).
  The next call raises it on every rank (through the fingerprint exchange);
- the calls appear in the timeline (TCOLL_TRACE), from their queueing to the
  moment the watchdog sees them done.
"""

from __future__ import annotations

import weakref
from typing import Any

import numpy as np

from ..algos.select import NCCL_COLLECTIVES
from ..errors import MismatchError, PeerFailedError, TcollError
from ..ops import OPS as BUILTIN_OPS
from ..ops import as_op
from ..p2p.timeline import now_us
from .nccl_lib import OPS, Nccl, NcclError, dtype_code
from .nccl_state import WATCHDOG, NcclState, NcclWork

__all__ = ["NCCL_CALLS", "NcclWork", "choose_path", "describe", "run"]

NCCL_CALLS = NCCL_COLLECTIVES  # (tcoll.algos.select: `tcoll explain --gpu` says the same)
_KINDS = {name: i + 1 for i, name in enumerate(NCCL_CALLS)}
_STAGED = 0  # a descriptor's kind when NCCL cannot take this rank's call: every rank stages it
_BROKEN = -1  # a descriptor's kind when this rank's NCCL communicator failed earlier
_ELSEWHERE = -2  # ... when the buffer is on another GPU than this rank's NCCL communicator
_WORDS = 6  # kind, op, dtype, count, root, out count


# -- which path: decided once per communicator, the same on every rank ------------------------------


def _gpu_identity(torch: Any, device: Any) -> str:
    """A name of the GPU that is the same in every process that uses it (its UUID where torch tells it)."""
    props = torch.cuda.get_device_properties(device)
    uuid = getattr(props, "uuid", None)
    if uuid is not None:
        return str(uuid)
    import socket
    return f"{socket.gethostname()}:{getattr(props, 'pci_bus_id', device.index)}"


def choose_path(comm: Any, torch: Any, device: Any, setting: str) -> str:
    """The communicator's path for CUDA buffers, "nccl" or "staging", agreed by every rank at its first CUDA call.

    Args:
        setting: TCOLL_GPU ("auto" or "nccl"; "staging" never asks).

    Raises:
        ValueError: setting "nccl" where NCCL cannot run (a shared GPU, or no NCCL on some rank): on every
            rank, naming the ranks.
    """
    try:
        Nccl.load()
        loaded = ""
    except NcclError as exc:
        loaded = str(exc)
    everyone = comm.all_gather_object((_gpu_identity(torch, device), loaded))
    gpus = [gpu for gpu, _ in everyone]
    shared = sorted(r for r, gpu in enumerate(gpus) if gpus.count(gpu) > 1)
    missing = {r: why for r, (_, why) in enumerate(everyone) if why}
    if not shared and not missing:
        return "nccl"
    if setting != "nccl":
        return "staging"
    if shared:
        raise ValueError(f"TCOLL_GPU=nccl: ranks {shared} share a GPU, and NCCL needs one GPU per rank; use "
                         "TCOLL_GPU=staging (or auto) where ranks share GPUs")
    raise ValueError("TCOLL_GPU=nccl: NCCL cannot be loaded on rank(s) " +
                     "; ".join(f"{r}: {why}" for r, why in missing.items()))


# -- one call -----------------------------------------------------------------------------------------


class _Plan:
    """What one NCCL call does on this rank: its description, buffers and result."""

    def __init__(self, name: str, words: list[int], tensors: dict[str, Any], result: Any) -> None:
        self.name, self.words, self.tensors, self.result = name, words, tensors, result


def _op_code(op: Any, floating: bool) -> int | None:
    """NCCL's code for a built-in reduce op (any spelling tcoll takes: "sum", "SUM", tcoll.SUM), or None
    (user ops, bitwise, logical; avg of integers)."""
    try:
        found = as_op(op)
    except (TypeError, ValueError):
        return None  # the staged call's own check names it
    name = found.name
    if BUILTIN_OPS.get(name) is not found or name not in OPS or (name == "avg" and not floating):
        return None
    return OPS[name]


def plan(name: str, args: dict[str, Any], torch: Any, size: int) -> _Plan | None:
    """The NCCL form of a call on torch CUDA tensors, or None where NCCL does not have it (staging runs it).

    Args:
        name: the Communicator method.
        args: its bound arguments (CUDA buffers already torch tensors), with defaults applied.
    """
    if name not in _KINDS or args.get("algorithm", "auto") != "auto":
        return None
    x = args["x"]
    code = dtype_code(str(x.dtype).rsplit(".", 1)[-1])
    if code is None or not x.is_contiguous():  # NCCL reads one span of memory: a strided buffer is staged
        return None
    floating = x.dtype.is_floating_point
    op = _op_code(args.get("op", "sum"), floating) if name in ("all_reduce", "reduce", "reduce_scatter") else 0
    if op is None:
        return None
    root = args.get("root", 0) if name in ("reduce", "broadcast") else 0
    if not isinstance(root, int) or not 0 <= root < size:
        return None  # staged: the CPU call's check raises, on every rank
    count = x.numel()
    shape = _result_shape(name, tuple(x.shape), size)
    if shape is None:
        return None
    out = args.get("out")
    if shape == ():
        result = x
    elif out is None:
        result = torch.empty(shape, dtype=x.dtype, device=x.device)
    else:
        result = out
        if tuple(out.shape) != shape or _overlap(x, out):  # staged: the CPU call's checks decide
            return None
    if result.dtype != x.dtype or result.device != x.device or not result.is_contiguous():
        return None
    return _Plan(name, [_KINDS[name], op, code, count, root, result.numel()], {"x": x, "out": result}, result)


def _result_shape(name: str, shape: tuple[int, ...], size: int) -> tuple[int, ...] | None:
    """The shape of the call's output as the CPU path makes it; () for in place; None: NCCL cannot take it."""
    if name == "all_gather":
        return (size, *shape)
    if name == "reduce_scatter":
        return (shape[0] // size, *shape[1:]) if shape and shape[0] % size == 0 else None
    if name == "all_to_all":
        return shape if shape and shape[0] == size else None  # the CPU's rule: one part per rank on axis 0
    return ()


def _overlap(a: Any, b: Any) -> bool:
    """Whether two tensors share memory (NCCL's own in-place layouts are not worth the special cases)."""
    a0, b0 = a.data_ptr(), b.data_ptr()
    return a0 < b0 + b.numel() * b.element_size() and b0 < a0 + a.numel() * a.element_size()


def describe(words: np.ndarray | list[int]) -> str:
    """A descriptor as words a user reads."""
    kind, op, dtype, count, root, out = (int(w) for w in words)
    if kind == _STAGED:
        return "a call NCCL does not take (staged)"
    if kind == _BROKEN:
        return "its NCCL communicator failed earlier"
    if kind == _ELSEWHERE:
        return "its buffer is on another GPU than its NCCL communicator (made at its first NCCL call)"
    name = NCCL_CALLS[kind - 1] if 0 < kind <= len(NCCL_CALLS) else f"call {kind}"
    ops = {v: k for k, v in OPS.items()}
    return f"{name}(count={count}, nccl dtype {dtype}, op {ops.get(op, op)}, root {root}, out {out})"


def agree(comm: Any, words: list[int], label: str) -> bool:
    """Compare this call's description with every rank's (CPU); raise on every rank where any differs.

    One small all_reduce (max of each word and of its negation) says whether every rank agrees; only
    where they do not do the ranks gather the descriptions, to name who differs. A rank that stages this
    call (kind _STAGED: NCCL does not have its op, dtype, layout or arguments there) makes every rank
    stage it, so that all of them make the same CPU call.

    Returns:
        True: queue it on NCCL; False: every rank stages it.

    Raises:
        PeerFailedError: some rank's NCCL communicator failed earlier (named).
        MismatchError: ranks describe different calls (the ranks that differ from rank 0 are named).
    """
    folded = _folded.get(comm)
    if folded is None:  # one buffer per communicator, so that its all_reduce goes whole in C from the second call
        folded = _folded[comm] = np.empty(2 * _WORDS, dtype=np.int64)
    folded[:_WORDS] = words
    np.negative(folded[:_WORDS], out=folded[_WORDS:])
    comm.all_reduce(folded, "max")  # every word's max and -min: equal everywhere when every rank agrees
    if words[0] >= _STAGED and np.array_equal(folded[:_WORDS], -folded[_WORDS:]):
        return words[0] != _STAGED
    # Some rank differs (or failed): every rank saw it in the same result, so every rank gathers the words.
    rows = comm.all_gather(np.array(words, dtype=np.int64))
    broken = [r for r in range(comm.size) if rows[r][0] in (_BROKEN, _ELSEWHERE)]
    if broken:
        raise PeerFailedError(f"{label} on NCCL: " + "; ".join(f"rank {r}: {describe(rows[r])}" for r in broken),
                              rank=broken[0])
    if any(row[0] == _STAGED for row in rows):
        return False  # its CPU call compares what each rank passed, and names who differs
    differ = [r for r in range(comm.size) if not np.array_equal(rows[r], rows[0])]
    if differ:
        raise MismatchError(f"{label} on CUDA buffers (NCCL): rank 0 calls {describe(rows[0])}, but " +
                            "; ".join(f"rank {r} calls {describe(rows[r])}" for r in differ),
                            ranks=differ if comm.rank == 0 else [r for r in range(comm.size)
                                                                  if not np.array_equal(rows[r], rows[comm.rank])])


def _queue(lib: Any, handle: int, p: _Plan, stream: int, size: int) -> None:
    """Queue the NCCL call of `p` on `stream`."""
    kind, op, code, count, root, out_count = p.words
    x, out = p.tensors["x"].data_ptr(), p.tensors["out"].data_ptr()
    name = p.name
    if name == "all_reduce":
        result = lib.ncclAllReduce(x, x, count, code, op, handle, stream)
    elif name == "reduce":
        result = lib.ncclReduce(x, x, count, code, op, root, handle, stream)
    elif name == "broadcast":
        result = lib.ncclBroadcast(x, x, count, code, root, handle, stream)
    elif name == "all_gather":
        result = lib.ncclAllGather(x, out, count, code, handle, stream)
    elif name == "reduce_scatter":
        result = lib.ncclReduceScatter(x, out, out_count, code, op, handle, stream)
    else:  # all_to_all: one send and one receive per rank, in one group
        part = count // size * p.tensors["x"].element_size()
        result = lib.ncclGroupStart()
        for q in range(size):
            if result == 0:
                result = lib.ncclSend(x + q * part, count // size, code, q, handle, stream)
            if result == 0:
                result = lib.ncclRecv(out + q * part, count // size, code, q, handle, stream)
        ended = lib.ncclGroupEnd()
        result = result or ended
    Nccl.load().check(result, f"nccl {name}", handle)


_states: weakref.WeakKeyDictionary[Any, NcclState] = weakref.WeakKeyDictionary()
_folded: weakref.WeakKeyDictionary[Any, np.ndarray] = weakref.WeakKeyDictionary()  # agree's buffer per communicator


def run(comm: Any, name: str, p: _Plan | None, async_op: bool, torch: Any, stream: Any) -> Any:
    """Check the call with every rank, then queue it on NCCL (or tell the caller to stage it).

    Args:
        comm: the tcoll communicator, whose path is "nccl".
        name: the Communicator method.
        p: the call's plan (`plan`), or None where NCCL cannot take it on this rank.
        async_op: return a NcclWork rather than the result.
        torch: the torch module.
        stream: the caller's current stream (a torch stream) for the first buffer.

    Returns:
        The call's result (its buffer or a new tensor), a NcclWork with async_op, or STAGE: every rank
        stages this call.

    Raises:
        MismatchError, PeerFailedError: the ranks' calls differ, or another rank's NCCL failed before.
        TimeoutError, TcollError: this rank's NCCL failed before (a call that timed out, an NCCL error).
    """
    state = _states.get(comm)
    mine = p.words if p is not None else [_STAGED, 0, 0, 0, 0, 0]
    if state is not None and state.error is not None:
        mine = [_BROKEN, 0, 0, 0, 0, 0]
    elif state is not None and p is not None and state.device != p.tensors["x"].device:
        mine = [_ELSEWHERE, 0, 0, 0, 0, 0]
    try:
        on_nccl = agree(comm, mine, name)
    except PeerFailedError:
        if state is not None and state.error is not None:  # this rank's own failure: its own words
            raise state.error from None
        raise
    if not on_nccl or p is None:
        return STAGE
    if state is None:
        state = _states[comm] = NcclState(comm, torch, p.tensors["x"].device, comm.core.engine.settings.timeout)
    began = now_us()
    event = torch.cuda.Event()
    with state.lock:  # an abort (the watchdog's, on an earlier call) never frees the handle under the queueing
        if state.aborted:
            raise state.error or TcollError(f"{name}: this communicator's NCCL was aborted")
        try:
            _queue(Nccl.load().lib, state.handle, p, stream.cuda_stream, comm.size)
        except NcclError as exc:  # the peers' part may be queued: fail the communicator, so they hear of it
            state.error = TcollError(f"{name} on NCCL failed on rank {comm.rank}: {exc}")
            failed = state.error
        else:
            failed = None
        event.record(stream)
    if failed is not None:
        state.abort()
        raise failed
    work = NcclWork(comm, state, event, f"{name} (rank {comm.rank})", p.result)
    timeline = getattr(comm.core.engine, "timeline", None)
    if timeline is not None:
        timeline.call(f"nccl {name}", began, work, {"count": p.words[3], "path": "nccl"})
    WATCHDOG.follow(work)
    return work if async_op else p.result


STAGE = object()  # run's answer: stage this call (every rank does)
