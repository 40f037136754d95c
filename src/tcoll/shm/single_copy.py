"""Single-copy reads of another rank's memory: Linux's cross-memory attach (process_vm_readv).

A plain NumPy array is private to its process, so the shared-memory
collectives copy it into the arena and the other ranks copy it out again:
two copies of every byte that crosses between ranks. With cross-memory
attach the kernel copies straight from the other process's pages into
this one's, once. MPICH and Open MPI use it for large messages on one
host ("CMA"). Where every rank of the arena can read every other, tcoll's
all_gather and all_to_all of 2 MiB or more use it by default
(TCOLL_SHM_SINGLE_COPY=auto, tcoll.shm.lending.read_lent), and its large
all_reduce with TCOLL_SHM_SINGLE_COPY=on (not faster than the arena's slots
on the CPU measured, docs/performance.md).

Whether it can is decided once per arena, when it opens (unless rank 0 has it off): each rank writes
its pid and the address of a word of its own into the arena, reads that
word of every other rank through process_vm_readv, and writes its verdict;
the arena uses single copies only if every verdict is yes, so every rank
takes the same path. Reads are refused where ptrace is (Yama's
ptrace_scope 2 or 3, a seccomp filter, another user), and then tcoll
copies through the arena as before.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
import sys

import numpy as np

__all__ = ["available", "read_into", "reads_back", "ReadFailed"]


class _IOVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("length", ctypes.c_size_t)]


def _load() -> object | None:
    """libc's process_vm_readv, or None where there is none (not Linux, or a libc without it)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        call = libc.process_vm_readv
    except (OSError, AttributeError):
        return None
    call.restype = ctypes.c_ssize_t
    call.argtypes = [ctypes.c_int, ctypes.POINTER(_IOVec), ctypes.c_ulong, ctypes.POINTER(_IOVec), ctypes.c_ulong,
                     ctypes.c_ulong]
    return call


_readv = _load()


class ReadFailed(OSError):
    """A read of another process's memory failed (errno says why: ESRCH, it is gone; EPERM, not allowed)."""


def available() -> bool:
    """Whether this process has process_vm_readv at all (whether a peer may be read is probed per arena)."""
    return _readv is not None


def read_into(pid: int, address: int, dest: np.ndarray) -> None:
    """Copy `dest.nbytes` bytes from `address` in process `pid` into `dest` (C-contiguous), in one kernel copy.

    Raises:
        ReadFailed: the kernel refused, or copied less (the process is gone, or the range is not mapped).
    """
    want = dest.nbytes
    done = 0
    local, remote = _IOVec(), _IOVec()
    base = dest.ctypes.data
    while done < want:  # the kernel may stop short at a page it could not read: try the rest once more
        local.base, local.length = base + done, want - done
        remote.base, remote.length = address + done, want - done
        got = _readv(pid, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)  # type: ignore[misc]
        if got <= 0:
            code = ctypes.get_errno() if got < 0 else errno.EFAULT
            raise ReadFailed(code, f"process_vm_readv of {want - done} bytes from pid {pid}: {os.strerror(code)}")
        done += got


def reads_back(identities: list[tuple[int, int]], me: int) -> bool:
    """Whether this rank (`me`) reads every other's pid word, at the address it gave, through its memory.

    Args:
        identities: per rank, (pid, the address of the word that holds it in that process); pid 0: the rank
            will not take part (TCOLL_SHM_SINGLE_COPY off there, or no process_vm_readv).
    """
    if identities[me][0] == 0:
        return False
    word = np.zeros(1, dtype=np.uint64)
    for rank, (pid, address) in enumerate(identities):
        if rank == me:
            continue
        try:
            read_into(pid, address, word)
        except OSError:  # refused (ptrace rules, seccomp), pid 0, or another pid namespace
            return False
        if pid == 0 or int(word[0]) != pid:
            return False
    return True
