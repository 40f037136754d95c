"""What the arena's C kernel (_arena_kernel.c) and the Python steps share, defined here and checked at import.

The kernel is C, so it cannot import these: it writes them too, and exports
its own (SETS, DESC_WORDS, PROGRESS_LINE, DTYPES, OPS). `check_kernel` compares the two when
this module is imported, and a kernel built from different constants (a stale
build, or an edit on one side only) is refused with ImportError, never used to
misread a slot. The kernel's part_bounds is tcoll.algos.topology.part_bounds
(tests/shm/test_kernel_constants.py compares them).
"""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np

from ..native import check_exports
from ..ops import AVG, BAND, BOR, BXOR, MAX, MIN, PROD, SUM

try:  # the small reduction step in C (_arena_kernel.c), built with the package where a compiler is
    from . import _arena_kernel as kernel_module
except ImportError:  # pragma: no cover - built without it: the same steps run in Python
    kernel_module = None  # type: ignore[assignment]

__all__ = ["DESC_WORDS", "KERNEL_DTYPES", "KERNEL_OPS", "PROGRESS_LINE", "SETS", "check_kernel", "kernel_module"]

SETS = 2  # slot sets: step k uses set k % SETS
DESC_WORDS = 8  # per rank and set: call stamp (2 words), sequence, zero-copy buffer (heap id, offset, nbytes)
PROGRESS_LINE = 64  # bytes per rank: the step it streams (+ 1) and its bytes written (the kernel's streamed steps)
# What Python relies on of the kernel's steps, numbered (a kernel built before would load and be wrong): 2,
# its split step stops where a peer lent its buffer (tcoll.shm.vector._reduce_split).
REVISION = 2
# What the C kernel reduces, by its codes; anything else is reduced in Python.
KERNEL_DTYPES = {np.dtype(t): code for code, t in enumerate(
    (np.float32, np.float64, np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64,
     np.float16, ml_dtypes.bfloat16))}
KERNEL_OPS = {SUM: 0, PROD: 1, MIN: 2, MAX: 3, BAND: 4, BOR: 5, BXOR: 6, AVG: 0}  # avg: a sum, divided later


def check_kernel(module: Any) -> None:
    """Refuse a built arena kernel whose shared constants differ from this module's.

    Args:
        module: the kernel extension, or None (not built: nothing to compare).

    Raises:
        ImportError: naming every constant that differs, and how to rebuild.
    """
    ops = sorted((code, op.name) for op, code in KERNEL_OPS.items() if op is not AVG)  # (avg runs as a sum)
    ours = {"SETS": SETS, "DESC_WORDS": DESC_WORDS, "PROGRESS_LINE": PROGRESS_LINE, "REVISION": REVISION,
            "OPS": tuple(name for _, name in ops),
            "DTYPES": tuple(dtype.name for dtype in sorted(KERNEL_DTYPES, key=KERNEL_DTYPES.__getitem__))}
    check_exports(module, ours, "tcoll.shm.kernel_abi", "the Python code it serves")


check_kernel(kernel_module)
