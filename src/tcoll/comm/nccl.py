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
  the rank; an asynchronous NCCL error aborts it too. The next call raises it
  on every rank (through the fingerprint exchange);
- the calls appear in the timeline (TCOLL_TRACE), from their queueing to the
  moment the watchdog sees them done.
"""

from __future__ import annotations

import threading
import time
import weakref
from typing import Any

import numpy as np

from ..algos.select import NCCL_COLLECTIVES
from ..errors import MismatchError, PeerFailedError, TcollError, TimeoutError
from .nccl_lib import OPS, Nccl, NcclError, dtype_code

__all__ = ["NCCL_CALLS", "NcclWork", "choose_path", "describe", "run"]

NCCL_CALLS = NCCL_COLLECTIVES  # (tcoll.algos.select: `tcoll explain --gpu` says the same)
_KINDS = {name: i + 1 for i, name in enumerate(NCCL_CALLS)}
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
    """NCCL's code for a reduce op given by name, or None (user ops, bitwise, logical; avg of integers)."""
    if not isinstance(op, str) or op not in OPS or (op == "avg" and not floating):
        return None
    return OPS[op]


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
    count = x.numel()
    out = args.get("out")
    if name == "all_gather":
        result = out if out is not None else torch.empty((size, *x.shape), dtype=x.dtype, device=x.device)
    elif name in ("reduce_scatter", "all_to_all"):
        if x.dim() == 0 or x.shape[0] % size:
            return None  # staging's own check names the problem
        shape = (x.shape[0] // size, *x.shape[1:]) if name == "reduce_scatter" else tuple(x.shape)
        result = out if out is not None else torch.empty(shape, dtype=x.dtype, device=x.device)
    else:
        result = x
    if result.dtype != x.dtype or result.device != x.device or not result.is_contiguous():
        return None
    return _Plan(name, [_KINDS[name], op, code, count, root, result.numel()], {"x": x, "out": result}, result)


def describe(words: np.ndarray | list[int]) -> str:
    """A descriptor as words a user reads."""
    kind, op, dtype, count, root, out = (int(w) for w in words)
    if kind == _BROKEN:
        return "its NCCL communicator failed earlier"
    if kind == _ELSEWHERE:
        return "its buffer is on another GPU than its NCCL communicator (made at its first NCCL call)"
    name = NCCL_CALLS[kind - 1] if 0 < kind <= len(NCCL_CALLS) else f"call {kind}"
    ops = {v: k for k, v in OPS.items()}
    return f"{name}(count={count}, nccl dtype {dtype}, op {ops.get(op, op)}, root {root}, out {out})"


def agree(comm: Any, words: list[int], label: str) -> None:
    """Compare this call's description with every rank's (CPU); raise on every rank where any differs.

    One small all_reduce (max of each word and of its negation) says whether every rank agrees; only
    then do the ranks gather the descriptions, to name who differs.

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
    if words[0] > 0 and np.array_equal(folded[:_WORDS], -folded[_WORDS:]):
        return
    # Some rank differs (or failed): every rank saw it in the same result, so every rank gathers the words.
    rows = comm.all_gather(np.array(words, dtype=np.int64))
    broken = [r for r in range(comm.size) if rows[r][0] in (_BROKEN, _ELSEWHERE)]
    if broken:
        raise PeerFailedError(f"{label} on NCCL: " + "; ".join(f"rank {r}: {describe(rows[r])}" for r in broken),
                              rank=broken[0])
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


# -- the NCCL communicator of a tcoll communicator, and the watchdog ----------------------------------


class _State:
    """One tcoll communicator's NCCL communicator: its handle, device, and the error that ended it."""

    def __init__(self, comm: Any, torch: Any, device: Any, timeout: float) -> None:
        lib = Nccl.load()
        uid = comm.broadcast_object(lib.unique_id() if comm.rank == 0 else None, 0)
        with torch.cuda.device(device):
            self.handle = lib.init_rank(comm.size, uid, comm.rank)
        self.device, self.timeout, self.rank = device, timeout, comm.rank
        self.error: TcollError | None = None
        self._lock = threading.Lock()
        self._aborted = False
        weakref.finalize(comm, self.abort)  # at the communicator's end: nothing may wait on it then

    def fail(self, error: TcollError) -> None:
        """Abort the NCCL communicator (its queued calls end) and keep `error` for the calls to come."""
        if self.error is None:
            self.error = error
            self.abort()

    def async_error(self) -> tuple[int, str]:
        """NCCL's error state of the communicator and its text; (0, "") once aborted (its handle is gone)."""
        with self._lock:  # an abort (the finalizer's, another thread's) never frees the handle under this call
            if self._aborted:
                return 0, ""
            try:
                code = Nccl.load().async_error(self.handle)
            except NcclError as exc:
                return -1, str(exc)
            return code, Nccl.load().error_text(code)

    def abort(self) -> None:
        """ncclCommAbort, once (a second would free the communicator twice)."""
        with self._lock:
            if self._aborted:
                return
            self._aborted = True
        try:
            Nccl.load().lib.ncclCommAbort(self.handle)
        except (NcclError, OSError):  # pragma: no cover - the library went away at exit
            pass


class NcclWork:
    """A queued NCCL call: done when the device has run it (an event after it on the caller's stream)."""

    def __init__(self, state: _State, event: Any, label: str, result: Any) -> None:
        self._state, self._event, self.label, self.value = state, event, label, result
        self._deadline = time.monotonic() + state.timeout
        self._callbacks: list[Any] = []
        self._finished = False
        self.error: TcollError | None = None

    def done(self) -> bool:
        """Whether the device has run the call (or it failed)."""
        return self._finished or self.error is not None or self._state.error is not None or self._event.query()

    def wait(self, timeout: float | None = None) -> Any:
        """Wait on the host until the device has run the call; return its result.

        Raises:
            TimeoutError: not done within `timeout` (the call goes on; the watchdog's own timeout aborts).
            TcollError: the watchdog failed it (timeout, NCCL error).
        """
        end = None if timeout is None else time.monotonic() + timeout
        pause = 2e-5
        while not self.done():
            if end is not None and time.monotonic() > end:
                raise TimeoutError(f"{self.label}: not done on the GPU within {timeout} s (rank {self._state.rank})")
            time.sleep(pause)
            pause = min(pause * 2, 1e-3)
        error = self.error or self._state.error
        if error is not None and not self._finished:
            raise error
        return self.value

    def result(self, timeout: float | None = None) -> Any:
        return self.wait(timeout)

    def exception(self) -> BaseException | None:
        return self.error

    def add_done_callback(self, fn: Any) -> None:
        """Call `fn(self)` once the watchdog sees the call done (the timeline's end of the call)."""
        self._callbacks.append(fn)

    def _check(self, now: float) -> bool:
        """The watchdog's look: True once the call is over (done, or failed here)."""
        if self._event.query():
            self._finished = True
        elif self._state.error is not None:
            self.error = self._state.error
        elif now > self._deadline:
            self.error = TimeoutError(f"{self.label} on NCCL did not finish on rank {self._state.rank}'s GPU "
                                      f"within {self._state.timeout:g} s; tcoll aborted the NCCL communicator "
                                      "(every rank passed the call's check: look at the GPUs and their links)")
            self._state.fail(self.error)
        else:
            return False
        for fn in self._callbacks:
            fn(self)
        return True


class _Watchdog:
    """One daemon thread per process that follows every queued NCCL call (see NcclWork._check)."""

    def __init__(self) -> None:
        self._works: list[NcclWork] = []
        self._lock = threading.Lock()
        self._busy = threading.Event()  # set while calls are followed: an idle watchdog sleeps on it
        self._thread: threading.Thread | None = None

    def follow(self, work: NcclWork) -> None:
        with self._lock:
            self._works.append(work)
            self._busy.set()
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="tcoll-nccl-watchdog", daemon=True)
                self._thread.start()

    def _run(self) -> None:
        while True:
            self._busy.wait()
            time.sleep(0.01)
            now = time.monotonic()
            with self._lock:
                works = list(self._works)
            over = [w for w in works if w._check(now)]
            states = {id(w._state): w._state for w in works if w not in over}
            for state in states.values():
                self._look_for_errors(state)
            if over:
                with self._lock:
                    self._works = [w for w in self._works if w not in over]
                    if not self._works:
                        self._busy.clear()

    @staticmethod
    def _look_for_errors(state: _State) -> None:
        """Fail a communicator whose NCCL reports an asynchronous error (a peer gone, a network failure)."""
        code, text = state.async_error()
        if code not in (0, 7):  # ncclSuccess, ncclInProgress
            state.fail(TcollError(f"NCCL reported an error on rank {state.rank}: {text}; tcoll aborted its "
                                  "NCCL communicator"))


_watchdog = _Watchdog()
_states: weakref.WeakKeyDictionary[Any, _State] = weakref.WeakKeyDictionary()
_folded: weakref.WeakKeyDictionary[Any, np.ndarray] = weakref.WeakKeyDictionary()  # agree's buffer per communicator


def run(comm: Any, p: _Plan, async_op: bool, torch: Any, stream: Any) -> Any:
    """Check the call with every rank, then queue it on NCCL.

    Args:
        comm: the tcoll communicator, whose path is "nccl".
        p: the call's plan (`plan`).
        async_op: return a NcclWork rather than the result.
        torch: the torch module.
        stream: the caller's current stream (a torch stream) for the first buffer.

    Returns:
        The call's result (its buffer or a new tensor), or a NcclWork with async_op.

    Raises:
        MismatchError, PeerFailedError: the ranks' calls differ, or another rank's NCCL failed before.
        TimeoutError, TcollError: this rank's NCCL failed before (a call that timed out, an NCCL error).
    """
    name = p.name
    state = _states.get(comm)
    device = p.tensors["x"].device
    mine = p.words
    if state is not None and state.error is not None:
        mine = [_BROKEN, 0, 0, 0, 0, 0]
    elif state is not None and state.device != device:
        mine = [_ELSEWHERE, 0, 0, 0, 0, 0]
    try:
        agree(comm, mine, name)
    except PeerFailedError:
        if state is not None and state.error is not None:  # this rank's own failure: its own words
            raise state.error from None
        raise
    if state is None:
        state = _states[comm] = _State(comm, torch, p.tensors["x"].device, comm.core.engine.settings.timeout)
    began = _now_us()
    _queue(Nccl.load().lib, state.handle, p, stream.cuda_stream, comm.size)
    event = torch.cuda.Event()
    event.record(stream)
    work = NcclWork(state, event, f"{name} (rank {comm.rank})", p.result)
    timeline = getattr(comm.core.engine, "timeline", None)
    if timeline is not None:
        timeline.call(f"nccl {name}", began, work, {"count": p.words[3], "path": "nccl"})
    _watchdog.follow(work)
    return work if async_op else p.result


def _now_us() -> float:
    return time.time_ns() / 1000.0
