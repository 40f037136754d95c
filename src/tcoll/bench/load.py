"""Background load for `tcoll bench --load`: busy processes that compete for the cores like another job."""

from __future__ import annotations

import subprocess
import sys

__all__ = ["LOAD_MARKER", "LoadGenerator"]

LOAD_MARKER = "tcoll-bench-load"
# A tight loop that also ends when its parent goes (checked every ~10 ms), so that a bench
# killed with SIGKILL leaves no spinning process behind.
_LOAD_CODE = ("import os\nparent = os.getppid()\nwhile os.getppid() == parent:\n"
              "    for _ in range(100000):\n        pass\n")


class LoadGenerator:
    """K busy processes (not niced: they compete like another job) for the life of a `with` block."""

    def __init__(self, count: int) -> None:
        self.count = count
        self.procs: list[subprocess.Popen[bytes]] = []

    def __enter__(self) -> LoadGenerator:
        try:
            for _ in range(self.count):
                self.procs.append(subprocess.Popen([sys.executable, "-c", _LOAD_CODE, LOAD_MARKER],
                                                   stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL))
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        """Kill and reap every load process (idempotent)."""
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
        for proc in self.procs:
            proc.wait()
        self.procs = []
