"""Zero-copy buffers: arrays in shared memory that the other ranks of the host can read directly.

`Communicator.empty` / `zeros` allocate here. Each buffer is its own memfd named
``tcoll-<run id>-<rank>-heap<id>`` (the id random, with the owner's pid in its
high bits), mapped by its owner; readers find it at /proc/<pid>/fd, so a rank
killed by any signal leaves nothing in /dev/shm. Where the ranks of a host do
not share a pid namespace, buffers are files in /dev/shm of that name instead,
removed when freed (and by `tcoll run` after a crash). When a
direct collective (tcoll.shm.vector, tcoll.shm.blocks) is given such a buffer, the rank
publishes (heap id, offset, length) instead of copying its data into the
arena; the readers map the file on first sight (and keep a bounded cache of
mappings) and read straight from it. This is the counterpart of NCCL's
user-buffer registration, without a registration call.

A buffer lives as long as its array does (or until the world communicator
closes); the mappings stay valid after that, so a reader that already
mapped a buffer keeps it. Readers keep at most `_PEER_MAPPED_BYTES` of other
ranks' buffers mapped, and drop the mappings of files already removed first.
"""

from __future__ import annotations

import os
import secrets
import threading
import weakref
from collections import OrderedDict
from typing import Any

import numpy as np

from ..errors import TransportError
from ..segments import (
    SHM_DIR,
    Segment,
    anonymous_link,
    find_anonymous,
    new_segment,
    segment_name,
    unlink,
)

__all__ = ["Heap", "heap_of"]

_PEER_MAPPED_BYTES = 1 << 30  # other ranks' buffers kept mapped (freed ones are dropped first)
_PID_SHIFT = 40  # heap ids: the owner's pid above this bit, random bits below


class Heap:
    """This process's zero-copy buffers, and its mappings of other ranks' buffers.

    Args:
        run_id: the job's name (part of every file name).
        world_rank: this rank in the world.
    """

    def __init__(self, run_id: str, world_rank: int, anonymous: bool = True) -> None:
        self._run_id = run_id or "local"
        self._rank = world_rank
        self._anonymous = anonymous
        self._lock = threading.Lock()
        # heap id -> (start address, nbytes, the memfd or the file path); never the mapping, which must be free to go
        self._own: dict[int, tuple[int, int, int | str]] = {}
        self._peer_paths: dict[tuple[int, int], str] = {}  # (rank, heap id) -> where it was mapped from
        self._peer_maps: OrderedDict[tuple[int, int], np.ndarray] = OrderedDict()
        self._closed = False

    def _name(self, world_rank: int, heap_id: int) -> str:
        return segment_name(self._run_id, world_rank, f"heap{heap_id}")

    def _path(self, world_rank: int, heap_id: int) -> str:
        return os.path.join(SHM_DIR, self._name(world_rank, heap_id))

    def allocate(self, nbytes: int) -> np.ndarray:
        """A new zero-filled uint8 array of `nbytes` bytes in shared memory.

        Raises:
            TransportError: /dev/shm is full or missing.
        """
        if self._closed:
            raise TransportError("the communicator that owns this shared-memory heap is closed")
        # Never 0 (descriptors use it for "not lent"); the pid tells readers where to look.
        heap_id = (os.getpid() << _PID_SHIFT) | (secrets.randbits(_PID_SHIFT - 1) << 1) | 1
        segment = new_segment(self._name(self._rank, heap_id), nbytes, anonymous=self._anonymous)
        arr = np.frombuffer(segment.map, dtype=np.uint8, count=nbytes)
        with self._lock:
            self._own[heap_id] = (arr.__array_interface__["data"][0], nbytes,
                                  segment.path if segment.fd is None else segment.fd)
        weakref.finalize(segment.map, self._release, heap_id)
        return arr

    def _release(self, heap_id: int) -> None:
        """The buffer's last array is gone: forget it and let go of its memory file."""
        with self._lock:
            entry = self._own.pop(heap_id, None)
        if entry is not None:
            _let_go(entry[2])

    def locate(self, arr: np.ndarray) -> tuple[int, int, int] | None:
        """Where `arr` lies in this process's buffers: (heap id, byte offset, nbytes), or None."""
        if not self._own:
            return None
        address = arr.__array_interface__["data"][0]
        end = address + arr.nbytes
        with self._lock:  # a finalizer on another thread may remove an entry meanwhile
            owned = list(self._own.items())
        for heap_id, (start, nbytes, _) in owned:
            if start <= address and end <= start + nbytes:
                return heap_id, address - start, arr.nbytes
        return None

    def view(self, world_rank: int, heap_id: int, offset: int, nbytes: int) -> np.ndarray:
        """Bytes [offset, offset + nbytes) of buffer `heap_id` of `world_rank` (mapped on first use).

        Raises:
            TransportError: the buffer's file is gone (its owner freed it).
        """
        key = (world_rank, heap_id)
        whole = self._peer_maps.get(key)
        if whole is None:
            whole = self._map_peer(world_rank, heap_id)
            self._forget_peer_maps(whole.nbytes)
            self._peer_maps[key] = whole
        else:
            self._peer_maps.move_to_end(key)
        return whole[offset:offset + nbytes]

    def _forget_peer_maps(self, incoming: int) -> None:
        """Make room for `incoming` mapped bytes: drop freed buffers, then the least recently used.

        A dropped mapping goes when its last view does, so its memory can return to the system.
        """
        for key in list(self._peer_maps):
            if not self._still_lent(key):  # its owner freed it: nobody will lend it again
                del self._peer_maps[key]
                self._peer_paths.pop(key, None)
        mapped = sum(view.nbytes for view in self._peer_maps.values())
        while self._peer_maps and mapped + incoming > _PEER_MAPPED_BYTES:
            mapped -= self._peer_maps.popitem(last=False)[1].nbytes

    def _still_lent(self, key: tuple[int, int]) -> bool:
        """Whether the owner still holds buffer `key` (a /proc fd may since name another file)."""
        path = self._peer_paths.get(key, "")
        if not self._anonymous:
            return os.path.exists(path)
        try:
            return os.readlink(path) == anonymous_link(self._name(*key))
        except OSError:
            return False

    def _map_peer(self, world_rank: int, heap_id: int) -> np.ndarray:
        name = self._name(world_rank, heap_id)
        if self._anonymous:
            path = find_anonymous(heap_id >> _PID_SHIFT, name) or ""
        else:
            path = self._path(world_rank, heap_id)
        try:
            # the name again: the fd find_anonymous saw may be freed and its number reused before we open it
            segment = Segment.open(path or name, name)
        except TransportError as exc:
            raise TransportError(f"rank {world_rank}'s shared buffer {heap_id} cannot be mapped "
                                 f"(freed, or its process is gone): {exc}") from exc
        self._peer_paths[(world_rank, heap_id)] = path
        return np.frombuffer(segment.map, dtype=np.uint8)

    def close(self) -> None:
        """Remove this process's files (arrays stay usable) and drop the peer mappings."""
        with self._lock:
            own, self._own = self._own, {}
            self._closed = True
        for _, _, handle in own.values():
            _let_go(handle)
        self._peer_maps.clear()
        self._peer_paths.clear()


def _let_go(handle: int | str) -> None:
    """Close an own buffer's memfd, or remove its file: its mappings stay valid."""
    if isinstance(handle, int):
        os.close(handle)
    else:
        unlink(handle)


_heaps: weakref.WeakKeyDictionary[Any, Heap] = weakref.WeakKeyDictionary()
_heaps_lock = threading.Lock()


def heap_of(engine: Any, run_id: str) -> Heap:
    """The heap of this engine's process (made on first use, removed when the engine closes)."""
    with _heaps_lock:
        heap = _heaps.get(engine)
        if heap is None:
            heap = _heaps[engine] = Heap(run_id, engine.rank, engine.host_shares_pids)
            engine.closers.append(heap.close)
    return heap
