"""CUDA buffers in the Communicator's calls, through host staging, ordered on the caller's current stream.

A call given a CUDA tensor (or a CuPy array, or anything with
`__cuda_array_interface__`) runs as the same call on pinned host copies:

    on the caller's current stream: device -> pinned host copy of every buffer the call reads
    wait for that stream (an event after the copies): the work queued before the call is in the copy
    tcoll's CPU call on the host copies (every op and dtype the CPU path has, user ops included)
    on the same stream: pinned host -> device copy of every buffer the call writes (non-blocking)

so work queued on that stream after the call sees the result, and the user
never synchronises by hand. The host copies stay referenced until an event
recorded after the copy back has passed. A buffer the call only writes (`out`,
a receive buffer) is not copied in; one it only reads is not copied back. With
async_op the copy back happens when the Work is waited for (wait() or
result()). A new array the call returns (all_gather without `out`) comes back
on the device of the call's first CUDA buffer, as the same kind (tensor or CuPy array).

The current stream is torch's for a tensor and CuPy's for a CuPy array. torch
does the copies (it wraps a CuPy array's memory without a copy), into pinned
shared memory from the communicator's pool (tcoll.comm.staging_pool). TCOLL_GPU
chooses the path: "staging" stages always; "nccl" and "auto" (where every rank
has a GPU of its own) run the calls NCCL has on NCCL (tcoll.comm.nccl) and
stage the rest. Persistent plans (`*_init`) take CPU buffers only.
"""

from __future__ import annotations

import collections
import functools
import inspect
import sys
import threading
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np

from . import nccl
from .staging_pool import HostPool, pool_of

__all__ = ["on_device", "staged", "install", "install_once", "STAGED"]

# Every Communicator call that takes buffers: (the arguments it reads, the arguments it writes). An argument in
# both is copied in and back; a list argument (scatter's chunks) is staged element by element.
STAGED: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "all_reduce": (("x",), ("x",)),
    "reduce": (("x",), ("x",)),
    "reduce_scatter": (("x",), ("out",)),
    "reduce_scatterv": (("x",), ("out",)),
    "scan": (("x",), ("x",)),
    "exscan": (("x",), ("x",)),
    "broadcast": (("x",), ("x",)),
    "all_gather": (("x",), ("out",)),
    "gather": (("x",), ("out",)),
    "scatter": (("chunks",), ("out",)),
    "all_to_all": (("x",), ("out",)),
    "all_gatherv": (("x",), ()),
    "gatherv": (("x",), ()),
    "scatterv": (("chunks",), ()),
    "all_to_allv": (("chunks",), ()),
    "sendrecv": (("sendbuf",), ("recvbuf",)),
    "sendrecv_replace": (("buf",), ("buf",)),
    "isend": (("buf",), ()),
    "irecv": ((), ("buf",)),
}


def on_device(obj: Any) -> bool:
    """Whether `obj` (or, for a list or tuple, any of its items) is a CUDA buffer tcoll stages.

    A NumPy array or CPU tensor answers in a type check or an attribute read.
    """
    if type(obj) is np.ndarray or obj is None:
        return False
    if isinstance(obj, (list, tuple)):
        return any(on_device(item) for item in obj)
    is_cuda = getattr(obj, "is_cuda", None)
    if is_cuda is not None:  # a torch tensor: its own answer (it also has __cuda_array_interface__)
        return bool(is_cuda)
    return hasattr(obj, "__cuda_array_interface__")


def _torch_cuda() -> Any:
    """torch, which does the copies; raises if this process has no torch with CUDA."""
    try:
        import torch
    except ImportError:
        raise TypeError("tcoll stages CUDA arrays through torch's CUDA copies; torch is not installed") from None
    if not torch.cuda.is_available():
        raise TypeError("a CUDA array was given, but torch sees no CUDA device in this process")
    return torch


class Stage:
    """The host copies of one call's CUDA buffers, and what copying back needs."""

    def __init__(self, torch: Any, pool: HostPool) -> None:
        self.torch, self.pool = torch, pool
        self.hosts: dict[int, tuple[Any, Any, Any, Any]] = {}  # id(host) -> (host, device tensor, origin, stream)
        self.streams: list[Any] = []
        self.first: tuple[Any, Any, Any] | None = None  # (device, stream, origin) of the first buffer
        self.taken: list[tuple[Any, Any]] = []  # (pool token, stream of its copies)

    def host(self, obj: Any, copy_in: bool) -> Any:
        """A pinned host stand-in for `obj` (a list of them for a list), filled from it if `copy_in`."""
        if isinstance(obj, (list, tuple)):
            return type(obj)(self.host(item, copy_in) for item in obj)
        if not on_device(obj):
            return obj
        torch = self.torch
        tensor, stream = _as_tensor(torch, obj)
        host, token = self.pool.take(tensor.nbytes, tensor.dtype, tuple(tensor.shape))
        if token is not None:
            self.taken.append((token, stream))
        if copy_in:
            with torch.cuda.stream(stream):
                host.copy_(tensor, non_blocking=True)
        self.hosts[id(host)] = (host, tensor, obj, stream)
        if stream not in self.streams:
            self.streams.append(stream)
        if self.first is None:
            self.first = (tensor.device, stream, obj)
        return host

    def ready(self) -> None:
        """Wait until every copy in, and the work queued before it on each stream, is done."""
        for stream in self.streams:
            event = self.torch.cuda.Event()
            event.record(stream)
            event.synchronize()

    def back(self, result: Any, written: list[Any]) -> Any:
        """Copy the written stand-ins back on their streams; return `result` in device terms.

        Args:
            result: what the CPU call returned (a stand-in, a new host array, a list of those, or anything).
            written: the stand-ins (or lists of them) of the arguments the call writes.
        """
        torch = self.torch
        keep: list[Any] = []
        for host in _flat(written):
            entry = self.hosts.get(id(host))
            if entry is not None:
                _, tensor, _, stream = entry
                with torch.cuda.stream(stream):
                    tensor.copy_(host, non_blocking=True)
                keep.append(host)
        mapped = self._device_form(result, keep)
        events = {}
        for stream in self.streams:  # the pinned memory stays referenced until the copies from it have run
            event = events[stream] = torch.cuda.Event()
            event.record(stream)
            _in_flight.append((event, keep))
        for token, stream in self.taken:  # pooled memory is reused once they have
            self.pool.give(token, events[stream])
        self.taken = []
        return mapped

    def drop(self) -> None:
        """The call failed: its pooled buffers are not reused (another rank may still read one)."""
        for token, _ in self.taken:
            self.pool.discard(token)
        self.taken = []

    def _device_form(self, value: Any, keep: list[Any]) -> Any:
        """`value` with stand-ins replaced by the user's buffers and new host arrays moved to the device."""
        if isinstance(value, list):
            return [self._device_form(v, keep) for v in value]
        entry = self.hosts.get(id(value))
        if entry is not None and entry[0] is value:
            return entry[2]
        torch = self.torch
        if self.first is None or not (isinstance(value, torch.Tensor) or isinstance(value, np.ndarray)):
            return value
        device, stream, origin = self.first
        host = value if isinstance(value, torch.Tensor) else torch.from_numpy(np.ascontiguousarray(value))
        with torch.cuda.stream(stream):
            moved = torch.empty(host.shape, dtype=host.dtype, device=device)
            moved.copy_(host, non_blocking=True)
        keep.append(host)
        return moved if isinstance(origin, torch.Tensor) else _like_origin(origin, moved)


_in_flight: collections.deque[tuple[Any, list[Any]]] = collections.deque()  # (event, host copies it guards)
_in_flight_lock = threading.Lock()


def _release_finished() -> None:
    """Let go of the host copies whose copy back has run (oldest first; stops at the first still running)."""
    with _in_flight_lock:  # calls on several threads release at once
        while _in_flight and _in_flight[0][0].query():
            _in_flight.popleft()


def _as_tensor(torch: Any, obj: Any) -> tuple[Any, Any]:
    """(a torch view of `obj`'s device memory, the caller's current stream for it).

    The view may be strided: staging copies it to and from contiguous host memory either way (and the
    NCCL path stages a strided buffer too), so no rank refuses one alone while the others wait.
    """
    if isinstance(obj, torch.Tensor):
        return obj.detach(), torch.cuda.current_stream(obj.device)
    tensor = torch.as_tensor(obj)  # __cuda_array_interface__: the same memory, on the array's own GPU
    return tensor, _foreign_stream(torch, obj, tensor.device)


def _foreign_stream(torch: Any, obj: Any, device: Any) -> Any:
    """The current stream of the library that made `obj` (CuPy's), as a torch stream; else torch's."""
    if type(obj).__module__.startswith("cupy"):
        import cupy

        return torch.cuda.ExternalStream(cupy.cuda.get_current_stream().ptr, device=device)
    return torch.cuda.current_stream(device)


def _like_origin(origin: Any, moved: Any) -> Any:
    """A new device tensor as the kind of `origin` (a CuPy array for CuPy; else the tensor)."""
    if type(origin).__module__.startswith("cupy"):
        import cupy

        return cupy.from_dlpack(moved)
    return moved


def _flat(items: Any) -> Any:
    for item in items:
        if isinstance(item, (list, tuple)):
            yield from _flat(item)
        else:
            yield item


class StagedWork:
    """The Work of an async call on CUDA buffers: waiting for it copies the results back (once)."""

    def __init__(self, work: Any, stage: Stage, written: list[Any]) -> None:
        self._work, self._stage, self._written = work, stage, written
        self._done = False
        self._value: Any = None

    def wait(self, timeout: float | None = None) -> Any:
        try:
            value = self._work.wait(timeout)
        except BaseException:
            self._stage.drop()
            raise
        if not self._done:
            self._value = self._stage.back(value, self._written)
            self._done = True
        return self._value

    def result(self, timeout: float | None = None) -> Any:
        return self.wait(timeout)

    def __getattr__(self, name: str) -> Any:  # done, exception, cancel, source, tag, nbytes, ...
        return getattr(self._work, name)


_Method = Callable[..., Any]
_ABSENT = object()  # "not given by position"


def staged(fn: _Method, reads: tuple[str, ...], writes: tuple[str, ...]) -> _Method:
    """Wrap a Communicator call so that CUDA buffers in `reads` / `writes` are staged through host memory.

    A call with no CUDA buffer runs as before, after a type check per buffer argument.
    """
    signature = inspect.signature(fn)
    names = list(signature.parameters)
    watched = tuple(dict.fromkeys(reads + writes))
    where = tuple((names.index(n) - 1, n) for n in watched)  # positions after `comm`

    @functools.wraps(fn)
    def call(comm: Any, *args: Any, **kwargs: Any) -> Any:
        for pos, name in where:
            value = args[pos] if pos < len(args) else kwargs.get(name)
            if type(value) is not np.ndarray and on_device(value):
                return _run(fn, signature, comm, args, kwargs, reads, writes)
        return fn(comm, *args, **kwargs)

    if len(where) == 1 and where[0][0] == 0:  # one buffer, the first argument: the check costs least so
        @functools.wraps(fn)
        def first(comm: Any, buf: Any = _ABSENT, *args: Any, **kwargs: Any) -> Any:
            if buf is _ABSENT:  # given by keyword
                return call(comm, *args, **kwargs)
            if type(buf) is not np.ndarray and on_device(buf):
                return _run(fn, signature, comm, (buf, *args), kwargs, reads, writes)
            return fn(comm, buf, *args, **kwargs)

        return first

    return call


def _run(fn: _Method, signature: inspect.Signature, comm: Any, args: tuple[Any, ...], kwargs: dict[str, Any],
         reads: tuple[str, ...], writes: tuple[str, ...]) -> Any:
    """Run `fn` on host stand-ins of its CUDA buffers (see the module's docstring)."""
    torch = _torch_cuda()
    _release_finished()
    bound = signature.bind(comm, *args, **kwargs)
    if fn.__name__ in nccl.NCCL_CALLS:
        done = _on_nccl(comm, fn.__name__, bound, torch)
        if done is not _ABSENT:
            return done
    stage = Stage(torch, pool_of(comm, torch))
    try:
        for name in dict.fromkeys(reads + writes):
            if name in bound.arguments:
                bound.arguments[name] = stage.host(bound.arguments[name], copy_in=name in reads)
        stage.ready()
        written = [bound.arguments[name] for name in writes if name in bound.arguments]
        result = fn(*bound.args, **bound.kwargs)
    except BaseException:
        stage.drop()
        raise
    if fn.__name__ in ("isend", "irecv") or bound.arguments.get("async_op"):
        return StagedWork(result, stage, written)
    return stage.back(result, written)


def _on_nccl(comm: Any, name: str, bound: inspect.BoundArguments, torch: Any) -> Any:
    """Run the call on NCCL where the communicator's path is NCCL and NCCL has it; else _ABSENT (stage it)."""
    setting = comm.core.engine.settings.gpu
    if setting == "staging":
        return _ABSENT
    origins = {n: v for n, v in bound.arguments.items() if n in ("x", "out") and on_device(v)}
    if "x" not in origins or any(isinstance(v, (list, tuple)) for v in origins.values()):
        return _ABSENT
    views = {n: _as_tensor(torch, v) for n, v in origins.items()}
    bound.apply_defaults()
    args = dict(bound.arguments)
    args.update({n: tensor for n, (tensor, _) in views.items()})
    path = _paths.get(comm)
    if path is None:  # every rank decides here, at its first CUDA collective NCCL has, whatever its arguments
        path = _paths[comm] = nccl.choose_path(comm, torch, views["x"][0].device, setting)
    if path != "nccl":
        return _ABSENT
    stream = views["x"][1]
    try:
        with torch.cuda.stream(stream):  # a new output is the stream's memory (CuPy's stream for a CuPy array)
            p = nccl.plan(name, args, torch, comm.size)
    except RuntimeError:  # the output's allocation failed here: every rank stages the call, none waits on this one
        p = None
    # Every rank on the NCCL path agrees on each such call, those that cannot take it on NCCL too: then all
    # of them stage it, or none does.
    result = nccl.run(comm, name, p, args.get("async_op", False), torch, stream)
    if result is nccl.STAGE:
        return _ABSENT
    work = result if isinstance(result, nccl.NcclWork) else None
    if work is not None:
        result = work.value
    for n, (tensor, _) in views.items():  # the user's own buffer back, as given (a CuPy array stays one)
        if result is tensor:
            result = origins[n]
            break
    else:
        result = _like_origin(origins["x"], result)
    if work is not None:
        work.value = result
        return work
    return result


_paths: weakref.WeakKeyDictionary[Any, str] = weakref.WeakKeyDictionary()  # communicator -> "nccl" | "staging"


def install(cls: type) -> None:
    """Wrap every call of STAGED on the Communicator class `cls`."""
    for name, (reads, writes) in STAGED.items():
        setattr(cls, name, staged(getattr(cls, name), reads, writes))


_installed: set[type] = set()


def install_once(cls: type, gpu: str) -> None:
    """Wrap the calls of `cls` (once) where this process may hold CUDA buffers: a machine without a GPU pays nothing.

    With gpu "auto", that is when torch is imported and sees a GPU, or CuPy is imported, by the time the
    first communicator is made; "staging" wraps them always (CUDA libraries imported later).
    """
    if cls in _installed:
        return
    if gpu == "auto":
        torch = sys.modules.get("torch")
        cuda = getattr(torch, "cuda", None)
        if "cupy" not in sys.modules and not (cuda is not None and cuda.is_available()):
            return
    _installed.add(cls)
    install(cls)
