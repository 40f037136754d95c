"""What a benchmark ran on: CPU, cores, kernel, versions and background load."""

from __future__ import annotations

import os
import platform
import sys

import numpy as np

__all__ = ["describe_machine"]


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as handle:
            for line in handle:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def describe_machine() -> str:
    """One line naming the CPU, usable cores, kernel, Python, NumPy and the load average."""
    from ..p2p.waiting import cpu_count

    load = ", ".join(f"{value:.2f}" for value in os.getloadavg())
    return (f"{_cpu_model()}, {cpu_count()} cores usable, Linux {platform.release()}, "
            f"Python {sys.version.split()[0]}, NumPy {np.__version__}, load average {load}")
