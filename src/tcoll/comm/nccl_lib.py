"""A thin ctypes binding of the NCCL library: the calls tcoll's NCCL path queues, and nothing else.

Why ctypes and not torch's ProcessGroupNCCL or nccl4py: tcoll keeps its own control plane (the
unique id through its own collectives, the fingerprint check on the CPU, its timeout and abort), so
it needs NCCL's calls and no second process group with its own store, watchdog and timeouts; a
ctypes layer (as vLLM's pynccl) needs no compiled extension and no package beyond the library
itself, which the `nvidia-nccl-cu*` wheel brings with every CUDA build of torch. The process loads
one NCCL: the one torch already loaded if any (by its soname), else the wheel's, else the system's.
TCOLL_NCCL_LIBRARY names a file to load instead.
"""

from __future__ import annotations

import ctypes
import glob
import os
from typing import Any

import numpy as np

SUCCESS, IN_PROGRESS = 0, 7
RESULTS = {0: "ncclSuccess", 1: "ncclUnhandledCudaError", 2: "ncclSystemError", 3: "ncclInternalError",
           4: "ncclInvalidArgument", 5: "ncclInvalidUsage", 6: "ncclRemoteError", 7: "ncclInProgress"}

# ncclDataType_t (nccl.h): the dtypes NCCL reduces and moves natively.
DTYPES = {np.dtype(np.int8): 0, np.dtype(np.uint8): 1, np.dtype(np.int32): 2, np.dtype(np.uint32): 3,
          np.dtype(np.int64): 4, np.dtype(np.uint64): 5, np.dtype(np.float16): 6, np.dtype(np.float32): 7,
          np.dtype(np.float64): 8}
BFLOAT16 = 9  # ncclBfloat16 (NCCL >= 2.10): keyed by name, since NumPy's bfloat16 is ml_dtypes'
# ncclRedOp_t: sum, prod, max, min, avg (avg: NCCL >= 2.10).
OPS = {"sum": 0, "prod": 1, "max": 2, "min": 3, "avg": 4}


class NcclError(RuntimeError):
    """A NCCL call returned an error: its result name and NCCL's own message."""


class UniqueId(ctypes.Structure):
    """ncclUniqueId: 128 opaque bytes that rank 0 makes and every rank passes to ncclCommInitRank."""

    _fields_ = [("internal", ctypes.c_byte * 128)]


def _candidates() -> list[str]:
    """The files to try, in order: TCOLL_NCCL_LIBRARY, the loaded soname, the wheel's, the system's."""
    named = os.environ.get("TCOLL_NCCL_LIBRARY")
    if named:
        return [named]
    found = ["libnccl.so.2"]  # dlopen by soname reuses the copy torch already loaded
    try:
        import nvidia.nccl  # the nvidia-nccl-cu* wheel
        for root in getattr(nvidia.nccl, "__path__", []):
            found += sorted(glob.glob(os.path.join(root, "lib", "libnccl.so*")))
    except ImportError:
        pass
    return found + ["libnccl.so"]


def _declare(lib: ctypes.CDLL) -> None:
    """Give each function its argument and result types (pointers stay 64-bit)."""
    p, i, sz, res = ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t, ctypes.c_int
    signatures = {
        "ncclGetVersion": [ctypes.POINTER(i)],
        "ncclGetUniqueId": [ctypes.POINTER(UniqueId)],
        "ncclCommInitRank": [ctypes.POINTER(p), i, UniqueId, i],
        "ncclCommDestroy": [p], "ncclCommAbort": [p],
        "ncclCommGetAsyncError": [p, ctypes.POINTER(i)],
        "ncclAllReduce": [p, p, sz, i, i, p, p],
        "ncclBroadcast": [p, p, sz, i, i, p, p],
        "ncclReduce": [p, p, sz, i, i, i, p, p],
        "ncclAllGather": [p, p, sz, i, p, p],
        "ncclReduceScatter": [p, p, sz, i, i, p, p],
        "ncclSend": [p, sz, i, i, p, p], "ncclRecv": [p, sz, i, i, p, p],
        "ncclGroupStart": [], "ncclGroupEnd": [],
    }
    for name, argtypes in signatures.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = argtypes, res
    lib.ncclGetErrorString.argtypes, lib.ncclGetErrorString.restype = [i], ctypes.c_char_p
    if hasattr(lib, "ncclGetLastError"):
        lib.ncclGetLastError.argtypes, lib.ncclGetLastError.restype = [p], ctypes.c_char_p


class Nccl:
    """The loaded library: each call checked, its error raised as NcclError."""

    _loaded: Nccl | None = None

    def __init__(self, lib: ctypes.CDLL, path: str) -> None:
        self.lib, self.path = lib, path
        _declare(lib)
        version = ctypes.c_int()
        self.check(lib.ncclGetVersion(ctypes.byref(version)), "ncclGetVersion")
        self.version = version.value  # e.g. 22803 for 2.28.3

    @classmethod
    def load(cls) -> Nccl:
        """The process's NCCL, loaded once.

        Raises:
            NcclError: no NCCL library could be loaded (the files tried, and why each failed).
        """
        if cls._loaded is None:
            failures = []
            for path in _candidates():
                try:
                    cls._loaded = cls(ctypes.CDLL(path), path)
                    break
                except (OSError, AttributeError) as exc:
                    failures.append(f"{path}: {exc}")
            else:
                raise NcclError("no NCCL library could be loaded (install torch with CUDA or nvidia-nccl-cu13, "
                                "or set TCOLL_NCCL_LIBRARY): " + "; ".join(failures))
        return cls._loaded

    def check(self, result: int, call: str, comm: Any = None) -> None:
        """Raise NcclError unless `result` is ncclSuccess."""
        if result == SUCCESS:
            return
        text = self.lib.ncclGetErrorString(result).decode(errors="replace")
        last = ""
        if comm is not None and hasattr(self.lib, "ncclGetLastError"):
            last = (self.lib.ncclGetLastError(comm) or b"").decode(errors="replace")
        raise NcclError(f"{call}: {RESULTS.get(result, result)} ({text}){': ' + last if last else ''}")

    def unique_id(self) -> bytes:
        """A new ncclUniqueId, as 128 bytes to send to the other ranks."""
        uid = UniqueId()
        self.check(self.lib.ncclGetUniqueId(ctypes.byref(uid)), "ncclGetUniqueId")
        return bytes(uid.internal)

    def init_rank(self, size: int, uid: bytes, rank: int) -> int:
        """ncclCommInitRank on the current CUDA device; returns the communicator's handle."""
        handle = ctypes.c_void_p()
        value = UniqueId()
        ctypes.memmove(value.internal, uid, 128)
        self.check(self.lib.ncclCommInitRank(ctypes.byref(handle), size, value, rank), "ncclCommInitRank")
        return handle.value

    def async_error(self, comm: int) -> int:
        """ncclCommGetAsyncError: the communicator's error state (0: none, 7: still in progress)."""
        state = ctypes.c_int()
        self.check(self.lib.ncclCommGetAsyncError(comm, ctypes.byref(state)), "ncclCommGetAsyncError", comm)
        return state.value

    def error_text(self, result: int) -> str:
        """NCCL's name and text for a result code."""
        return f"{RESULTS.get(result, result)} ({self.lib.ncclGetErrorString(result).decode(errors='replace')})"


def dtype_code(name: str) -> int | None:
    """NCCL's code for a dtype by its name ("float32", "bfloat16": NumPy's and torch's names agree), or None."""
    if name == "bfloat16":
        return BFLOAT16
    try:
        return DTYPES.get(np.dtype(name))
    except TypeError:  # a name NumPy does not know (torch's complex32, say)
        return None
