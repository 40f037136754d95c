"""An arena's memory in this process, where a test plays the other rank word by word (the C kernel's tests)."""

from __future__ import annotations

from collections import Counter
from typing import Any

import numpy as np

from tcoll.shm import arena as arena_module
from tcoll.shm.kernel_abi import PROGRESS_LINE

__all__ = ["CountingKernel", "FakeArena", "STAMP", "counted_kernel"]


class CountingKernel:
    """Stands in for an arena's kernel and counts what each run, run_split and run_blocks returned (a
    broadcast's or barrier's run_broadcast, and the rest, pass through uncounted)."""

    def __init__(self, kernel: Any) -> None:
        self.kernel, self.states = kernel, Counter()

    def _counted(self, state: int) -> int:
        self.states[state] += 1
        return state

    def run(self, *args: Any) -> int:
        return self._counted(self.kernel.run(*args))

    def run_split(self, *args: Any) -> int:
        return self._counted(self.kernel.run_split(*args))

    def run_blocks(self, *args: Any) -> int:
        return self._counted(self.kernel.run_blocks(*args))

    def __getattr__(self, name: str) -> Any:
        return getattr(self.kernel, name)


def counted_kernel(comm: Any, counting: type, python_rank: int = -1) -> Any:
    """Make `comm`'s arena and wrap its kernel in `counting` (a CountingKernel-like class); rank `python_rank`
    runs without the kernel (the Python steps). The counting wrapper, on every rank."""
    comm.barrier(algorithm="shm")  # makes the arena
    arena = comm.core.dispatch.arena
    wrapper = counting(arena.kernel)
    arena.kernel = None if comm.rank == python_rank else wrapper
    return wrapper


class FakeArena:
    """An arena's memory in this process, seen as rank 0 of 2; the test plays rank 1 by writing its words."""

    SLOT = 4096

    def __init__(self) -> None:
        import mmap

        self.desc_at, self.data_at = arena_module._layout(2)
        bell_at = arena_module.arena_bytes(2, self.SLOT)  # the peer's doorbell, past the arena
        self.map = mmap.mmap(-1, bell_at + 8)
        self.counters = np.frombuffer(self.map, np.uint64, 2, 0)
        self.desc = np.frombuffer(self.map, np.uint64, 2 * 2 * 8, self.desc_at)
        self.bell = np.frombuffer(self.map, np.uint32, 2, bell_at)  # sequence, sleepers
        self.kernel = arena_module.kernel_module.Kernel(
            self.map, self.desc_at, self.data_at, 2, 0, self.SLOT, [memoryview(self.map)[bell_at:bell_at + 8]])

    def slot(self, rank: int, step: int, dtype: Any, count: int) -> np.ndarray:
        offset = self.data_at + ((step % 2) * 2 + rank) * self.SLOT
        return np.frombuffer(self.map, dtype, count, offset)

    def progress(self, rank: int) -> np.ndarray:
        """Rank `rank`'s progress line (streamed steps): the step it streams (+ 1), its bytes written."""
        at = (self.desc_at + 8 * 8 * 2 * 2 + 63) & ~63  # (after the descriptors: tcoll.shm.arena._layout)
        return np.frombuffer(self.map, np.uint64, 2, at + PROGRESS_LINE * rank)

    def peer_publishes(self, step: int, stamp: int, sequence: int, values: np.ndarray) -> None:
        at = ((step % 2) * 2 + 1) * 8
        self.desc[at:at + 4] = [stamp & (2**64 - 1), stamp >> 64, sequence, 0]
        self.slot(1, step, values.dtype, values.size)[...] = values
        self.counters[1] = step + 1

    def run(self, buf: np.ndarray, step: int, stamp: int, sequence: int, want: bool = True) -> int:
        code = arena_module.KERNEL_DTYPES[buf.dtype]
        return self.kernel.run(buf, code, 0, step, stamp, sequence, 0, False, want)


STAMP = (0xFEED << 64) | 0xBEEF  # a stamp with both 64-bit halves set
