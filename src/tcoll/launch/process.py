"""Operating-system plumbing of the launcher: exit codes, process groups, wake-ups, shm cleanup.

Each rank runs in its own session (so its own process group): the launcher
alone decides when it stops, and a signal to the group also reaches the
rank's own children. A rank's group is killed as soon as the rank exits,
while the rank is still an unreaped zombie: the zombie keeps the group id
reserved, so the kill can never hit an unrelated process that reused the id.
"""

from __future__ import annotations

import ctypes
import dataclasses
import os
import select
import signal
import subprocess
import sys
from collections.abc import Callable

from tcoll.launch.output import LineForwarder
from tcoll.segments import SHM_DIR, remove_shm_segments

__all__ = [
    "SHM_DIR",
    "RankProcess",
    "Waker",
    "describe_exit",
    "exit_code",
    "parent_death_hook",
    "remove_shm_segments",
    "signal_group",
]


def exit_code(returncode: int) -> int:
    """Map a `Popen.returncode` to a shell-style exit code (128 + N for signal N)."""
    return 128 - returncode if returncode < 0 else returncode


def describe_exit(returncode: int) -> str:
    """Describe how a process ended, e.g. ``"exited with code 3"``, ``"was killed by SIGKILL"``."""
    if returncode >= 0:
        return f"exited with code {returncode}"
    try:
        name = signal.Signals(-returncode).name
    except ValueError:
        name = f"signal {-returncode}"
    return f"was killed by {name}"


def signal_group(pgid: int, signum: int) -> None:
    """Send a signal to a process group, ignoring a group that is already gone."""
    try:
        os.killpg(pgid, signum)
    except (ProcessLookupError, PermissionError):
        pass


def _find_prctl() -> Callable[[int, int], int] | None:
    """Look up libc's prctl (Linux only), once, before any fork."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True).prctl  # type: ignore[no-any-return]
    except (OSError, AttributeError):
        return None


_PRCTL = _find_prctl()


def parent_death_hook() -> Callable[[], None] | None:
    """Build a pre-exec hook that makes a rank die with this process (Linux PR_SET_PDEATHSIG).

    Without it a launcher killed by SIGKILL would leave its ranks running. The
    hook makes one system call in the child and takes no lock, so it is safe
    to run after a fork while other threads exist.

    Returns:
        The hook for `subprocess.Popen(preexec_fn=...)`, or None where unsupported.
    """
    prctl = _PRCTL
    if prctl is None:
        return None
    launcher, kill = os.getpid(), int(signal.SIGKILL)

    def hook() -> None:
        """Runs in the child between fork and exec."""
        prctl(1, kill)  # 1 = PR_SET_PDEATHSIG
        if os.getppid() != launcher:  # the launcher died before prctl took effect
            os._exit(1)

    return hook


class Waker:
    """A self-pipe the main loop sleeps on; signals (via set_wakeup_fd) and threads write to it.

    Not a threading.Event: setting an Event from a signal handler can deadlock
    on the Event's own lock when the handler interrupts the main thread inside it.
    """

    def __init__(self) -> None:
        self.closed = False
        self.read_fd, self.write_fd = os.pipe()
        os.set_blocking(self.read_fd, False)
        os.set_blocking(self.write_fd, False)

    def set(self) -> None:
        """Wake the sleeper (callable from any thread)."""
        if self.closed:
            return
        try:
            os.write(self.write_fd, b"!")
        except (BlockingIOError, OSError):
            pass  # a full pipe already means "wake up"; a closed one means we are done

    def wait(self, timeout: float) -> None:
        """Sleep until woken or `timeout` seconds pass, then forget pending wake-ups."""
        readable, _, _ = select.select([self.read_fd], [], [], max(timeout, 0.0))
        if readable:
            try:
                while os.read(self.read_fd, 4096):
                    pass
            except BlockingIOError:
                pass

    def close(self) -> None:
        """Close both ends."""
        self.closed = True
        os.close(self.read_fd)
        os.close(self.write_fd)


@dataclasses.dataclass
class RankProcess:
    """One started rank: its process and the forwarders of its output."""

    rank: int
    proc: subprocess.Popen[bytes]
    out: LineForwarder
    err: LineForwarder

    def reap(self) -> bool:
        """Return True if the rank has exited, killing what is left of its group first."""
        if self.proc.returncode is not None:
            return True
        try:
            info = os.waitid(os.P_PID, self.proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:  # already reaped: let Popen record it
            return self.proc.poll() is not None
        if info is None:
            return False
        signal_group(self.proc.pid, signal.SIGKILL)  # still a zombie: the group id is ours
        self.proc.wait()
        return True


