"""Adaptive waiting: spin briefly, then yield, then block on a futex doorbell.

A `Doorbell` is an eventcount in memory that several processes map: a 32-bit
sequence word that wakers bump, and a count of sleeping threads that only the
owner writes. A waker publishes its data, fences, and only if somebody sleeps
does it pay for a system call (FUTEX_WAKE_OP, which bumps the sequence
atomically and wakes in one call). A sleeper announces itself, fences,
re-checks for work, and then sleeps on the sequence value it read *before*
announcing, so a wake that lands in between is never lost.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import platform
import threading
import time

__all__ = ["Doorbell", "SpinPolicy", "fence", "cpu_count", "bind_share", "FUTEX_AVAILABLE", "FENCE_LOCK"]

_FUTEX_SYSCALL = {"x86_64": 202, "amd64": 202, "aarch64": 98, "arm64": 98, "riscv64": 98,
                  "ppc64le": 221, "s390x": 238, "i686": 240, "i386": 240}.get(platform.machine().lower())
_FUTEX_WAIT = 0
_FUTEX_WAKE_OP = 5
_FUTEX_OP_ADD = 1
_FUTEX_OP_CMP_EQ = 0
# uaddr2 += 1, then wake waiters on uaddr (the same word) unconditionally.
_WAKE_OP_ADD_ONE = (_FUTEX_OP_ADD << 28) | (_FUTEX_OP_CMP_EQ << 24) | (1 << 12) | 0
_INT_MAX = 0x7FFFFFFF

try:
    _libc = ctypes.CDLL(None, use_errno=True)
    _syscall = _libc.syscall
    _syscall.restype = ctypes.c_long
    FUTEX_AVAILABLE = _FUTEX_SYSCALL is not None and platform.system() == "Linux"
except (OSError, AttributeError):  # pragma: no cover - non-Linux
    FUTEX_AVAILABLE = False


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


FENCE_LOCK = threading.Lock()  # acquired and released: a fence (hot paths bind its methods)


def fence() -> None:
    """Full memory barrier between this thread's stores and its later loads.

    Acquiring and releasing a lock executes locked instructions, which order
    stores before later loads on x86-64 (the reason a plain flag check after a
    publish is not enough: the store could still sit in the store buffer).
    """
    FENCE_LOCK.acquire()
    FENCE_LOCK.release()


def cpu_count() -> int:
    """The number of CPUs this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - non-Linux
        return os.cpu_count() or 1


def bind_share(index: int, count: int) -> list[int] | None:
    """Keep this thread to its share of the usable cores: share `index` of `count` equal ones.

    Two ranks that poll on one core while another idles take turns by time
    slice; the scheduler puts a woken rank next to the rank that woke it, so
    communicating ranks drift together. Returns the cores kept, or None when
    there are fewer cores than shares (or no affinity control): nothing changes.
    """
    try:
        cores = sorted(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - non-Linux
        return None
    if count < 2 or len(cores) < count or not 0 <= index < count:
        return None
    per = len(cores) // count
    mine = cores[index * per:(index + 1) * per]
    try:
        os.sched_setaffinity(0, mine)
    except OSError:  # pragma: no cover - a container that forbids it
        return None
    return mine


def _address_of(buf: mmap.mmap, offset: int) -> int:
    """The address of byte `offset` of a mapping (valid while the mapping lives)."""
    anchor = ctypes.c_char.from_buffer(buf, offset)
    address = ctypes.addressof(anchor)
    del anchor  # release the export so the mapping can be closed later
    return address


class Doorbell:
    """An eventcount in (possibly shared) memory: 8 bytes at `offset` of `buf`.

    Layout: uint32 sequence (bumped by wakers), uint32 sleepers (owner only).
    The owner calls prepare_sleep / sleep / end_sleep; any process that maps the
    same memory may call ring.
    """

    SIZE = 8

    def __init__(self, buf: mmap.mmap, offset: int = 0) -> None:
        if offset % 4:
            raise ValueError("a doorbell must be 4-byte aligned")
        self._words = memoryview(buf)[offset:offset + self.SIZE].cast("I")
        self._address = _address_of(buf, offset)

    @classmethod
    def private(cls) -> Doorbell:
        """A doorbell in anonymous memory, for waking threads of this process."""
        return cls(mmap.mmap(-1, mmap.PAGESIZE), 0)

    @property
    def memory(self) -> memoryview:
        """The doorbell's 8 bytes (uint32 sequence, uint32 sleepers), for code that rings it from C."""
        return self._words

    @property
    def sleepers(self) -> int:
        """How many of the owner's threads announced they sleep (or are about to)."""
        try:
            return self._words[1]
        except ValueError:  # released by close()
            return 0

    def ring(self) -> None:
        """Wake the owner if it sleeps. Call after publishing the data it waits for."""
        fence()
        if self._words[1]:
            self.wake()

    def wake(self) -> None:
        """Bump the sequence and wake every sleeper, unconditionally."""
        if FUTEX_AVAILABLE:
            _syscall(_FUTEX_SYSCALL, ctypes.c_void_p(self._address), _FUTEX_WAKE_OP, _INT_MAX,
                     ctypes.c_void_p(_INT_MAX), ctypes.c_void_p(self._address), _WAKE_OP_ADD_ONE)
        else:  # pragma: no cover - non-Linux: sleepers poll
            self._words[0] = (self._words[0] + 1) & 0xFFFFFFFF

    def prepare_sleep(self) -> int:
        """Announce a sleeper; returns the sequence to pass to sleep().

        The caller must hold the owner's lock (sleepers has one writer) and must
        re-check for work after this call and before sleep().
        """
        seq = self._words[0]
        self._words[1] = self._words[1] + 1
        fence()
        return seq

    def end_sleep(self) -> None:
        """Withdraw the announcement made by prepare_sleep (owner's lock held)."""
        try:
            self._words[1] = self._words[1] - 1
        except ValueError:  # released by close() while this thread slept: nothing left to withdraw
            pass

    def sleep(self, seq: int, timeout: float) -> None:
        """Block until the sequence moves past `seq` or `timeout` seconds pass (GIL released)."""
        if timeout <= 0:
            return
        if not FUTEX_AVAILABLE:  # pragma: no cover
            time.sleep(min(timeout, 0.001))
            return
        ts = _Timespec(int(timeout), int((timeout % 1.0) * 1e9))
        _syscall(_FUTEX_SYSCALL, ctypes.c_void_p(self._address), _FUTEX_WAIT, ctypes.c_uint32(seq),
                 ctypes.byref(ts), None, 0)

    def release(self) -> None:
        """Drop the view into the mapping so that it can be closed (once nothing else holds the view)."""
        try:
            self._words.release()
        except BufferError:  # the arena's C kernel still holds it: the mapping goes when the kernel does
            pass


class SpinPolicy:
    """A self-tuning budget for how long a waiter polls before it blocks.

    Polling wins when the awaited event comes within about one wake-up latency
    (20-50 us on an idle machine); beyond that it only burns a core another
    rank may need. The budget shrinks while waits keep outlasting it and grows
    back while they end inside it. Only the first `yield_after_us` of a wait
    poll flat out; after that each poll yields the CPU (sched_yield), so a
    peer rank or another job that shares this core runs at once instead of
    after this rank's time slice: on a loaded machine that is the difference
    between tens and hundreds of microseconds per call, on a quiet one it
    costs a system call per poll. When ranks outnumber cores the ceiling is
    low and every poll yields.

    Args:
        max_us: the ceiling of the budget, in microseconds.
        oversubscribed: more busy ranks than cores on this host.
        yield_after_us: microseconds of flat-out polling before polls yield.
    """

    MIN_US = 2.0

    def __init__(self, max_us: float, oversubscribed: bool, yield_after_us: float = 50.0) -> None:
        self.oversubscribed = oversubscribed
        self.max_s = (min(max_us, 20.0) if oversubscribed else max_us) * 1e-6
        self.budget_s = self.max_s
        self.fast_s = 0.0 if oversubscribed else yield_after_us * 1e-6  # polls flat out this long, then yields
        self._hits = 0.5  # moving average of "the wait ended while polling"

    @property
    def yield_while_polling(self) -> bool:
        """Whether each poll should yield the CPU to other runnable ranks."""
        return self.oversubscribed

    def record(self, waited_s: float, blocked: bool) -> None:
        """Learn from one finished wait: how long it took, and whether it blocked.

        A wait that blocked but ended soon after the budget ran out would have
        been caught by a longer budget: grow it. Waits that keep outlasting the
        budget by far only burn CPU while polling: shrink it.
        """
        self._hits = 0.9 * self._hits + (0.0 if blocked else 0.1)
        if blocked and waited_s < 2 * self.max_s:
            self.budget_s = min(self.max_s, self.budget_s * 2 + 1e-6)
        elif self._hits < 0.2:
            self.budget_s = max(self.MIN_US * 1e-6, self.budget_s * 0.7)
        elif self._hits > 0.5:
            self.budget_s = min(self.max_s, self.budget_s * 1.5 + 1e-6)
