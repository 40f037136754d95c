"""The host memory that CUDA buffers are staged through: shared memory, pinned for CUDA, kept and reused.

A staged call copies each CUDA buffer into host memory, runs tcoll's CPU call
there, and copies back. Where that host memory comes from decides two costs:

- **the CPU call**: memory from `comm.empty` is lent to the shared-memory
  collectives, which read it where it lies (a large all_reduce reduces straight
  from the ranks' buffers), where ordinary memory is first copied through the
  arena's slots;
- **the copies**: pinned memory is copied by the GPU's copy engine, at full
  speed and without blocking the host; pageable memory is not.

So a pool per communicator keeps buffers from `comm.empty`, each registered with
CUDA (cudaHostRegister, as torch's pinned memory is), and hands them out again:
registration and the other ranks' first mapping of a buffer are paid once. A
buffer goes back to the pool when its call is over and an event after the copy
back has passed. Below MIN_BYTES (where a call copies through a slot anyway) and
where registration fails, torch's own pinned memory serves, from its caching allocator.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

import numpy as np

from ..errors import TcollError

__all__ = ["HostPool", "pool_of", "MIN_BYTES"]

MIN_BYTES = 64 << 10  # smaller buffers: torch's pinned memory (its caching allocator keeps them too)
_PORTABLE = 1  # cudaHostRegisterPortable
MAX_BUFFERS = 16  # per communicator; beyond, torch's pinned memory serves (a call holding many at once)


class _Buffer:
    """One registered shared-memory buffer and what it is doing."""

    def __init__(self, array: np.ndarray, tensor: Any) -> None:
        self.array, self.tensor = array, tensor  # uint8 views of the same memory
        self.capacity = array.nbytes
        self.busy = False
        self.event: Any = None  # recorded after the last copy out of it; it may be reused once passed

    def free(self) -> bool:
        return not self.busy and (self.event is None or self.event.query())


class HostPool:
    """Pinned shared-memory buffers of one communicator (see the module docstring).

    Args:
        comm: the communicator whose `empty` lends the memory.
        torch: the torch module (with CUDA).
    """

    def __init__(self, comm: Any, torch: Any) -> None:
        self._comm = weakref.ref(comm)
        self._torch = torch
        self._buffers: list[_Buffer] = []
        self._retired: list[_Buffer] = []
        self._unpinnable = False
        self._lock = threading.Lock()  # calls of one communicator may run on several threads
        self._registered: list[int] = []
        weakref.finalize(self, _unregister, torch, self._registered)

    def take(self, nbytes: int, dtype: Any, shape: tuple[int, ...]) -> tuple[Any, Any]:
        """A pinned host tensor of `shape` and torch `dtype`, and the token that gives it back (None: not pooled).

        Raises:
            RuntimeError: torch could not allocate pinned memory either.
        """
        torch = self._torch
        if nbytes >= MIN_BYTES:
            with self._lock:
                buffer = self._reuse(nbytes) or self._grow(nbytes)
                if buffer is not None:
                    buffer.busy = True
            if buffer is not None:
                return buffer.tensor[:nbytes].view(dtype).view(shape), buffer
        return torch.empty(shape, dtype=dtype, pin_memory=True), None

    def give(self, buffer: _Buffer | None, event: Any) -> None:
        """Take `buffer` back; it is reused once `event` (recorded after the copies from it) has passed."""
        if buffer is not None:
            with self._lock:
                buffer.event, buffer.busy = event, False

    def discard(self, buffer: _Buffer | None) -> None:
        """Never hand `buffer` out again (its call failed, so another rank may still read it); it stays pinned."""
        if buffer is not None:
            with self._lock:
                self._buffers.remove(buffer)
                self._retired.append(buffer)  # mapped and registered until the pool goes, as the others

    def _reuse(self, nbytes: int) -> _Buffer | None:
        """The smallest free buffer that holds `nbytes`, if it is no more than 4x too large."""
        fits = [b for b in self._buffers if nbytes <= b.capacity <= 4 * nbytes and b.free()]
        return min(fits, key=lambda b: b.capacity, default=None)

    def _grow(self, nbytes: int) -> _Buffer | None:
        """A new registered buffer of at least `nbytes` (a power of two), or None where none can be made."""
        comm = self._comm()
        if comm is None or self._unpinnable or len(self._buffers) + len(self._retired) >= MAX_BUFFERS:
            return None
        capacity = 1 << (nbytes - 1).bit_length()
        try:
            array = comm.empty(capacity, np.uint8)
        except TcollError:  # /dev/shm full, say: torch's pinned memory serves, and nothing fails on one rank
            return None
        address = array.__array_interface__["data"][0]
        try:  # portable: pinned for every GPU's context, whichever device the calls use
            registered = int(self._torch.cuda.cudart().cudaHostRegister(address, capacity, _PORTABLE)) == 0
        except (AttributeError, RuntimeError):  # a torch without the binding
            registered = False
        if not registered:
            self._unpinnable = True  # a locked-memory limit, say: not tried again
            return None
        self._registered.append(address)
        buffer = _Buffer(array, self._torch.from_numpy(array))
        self._buffers.append(buffer)
        return buffer


def _unregister(torch: Any, addresses: list[int]) -> None:
    """Undo the registrations before the pool's memory can be unmapped (a later mapping may reuse the range)."""
    for address in addresses:
        torch.cuda.cudart().cudaHostUnregister(address)


_pools: weakref.WeakKeyDictionary[Any, HostPool] = weakref.WeakKeyDictionary()
_pools_lock = threading.Lock()


def pool_of(comm: Any, torch: Any) -> HostPool:
    """The staging pool of `comm` (made on first use)."""
    with _pools_lock:
        pool = _pools.get(comm)
        if pool is None:
            pool = _pools[comm] = HostPool(comm, torch)
        return pool
