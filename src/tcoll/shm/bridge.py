"""The direct algorithms' calls into the arena's C kernel: reduce and copy in C where the arena has the
kernel and it takes the dtype and op, with NumPy otherwise (the same results, bit for bit).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..ops import OPS
from .kernel_abi import KERNEL_DTYPES, KERNEL_OPS, kernel_module

__all__ = ["kernel_codes", "combine_all", "reduce_into", "copy_bytes", "run_phases"]


def kernel_codes(arena: Any, dtype: np.dtype, op: Any) -> tuple[int, int] | None:
    """The C kernel's codes of `dtype` and `op`, or None: the arena has no kernel, or it does not take them."""
    if arena.kernel is None:
        return None
    dtype_code, op_code = KERNEL_DTYPES.get(dtype), KERNEL_OPS.get(op)
    return None if dtype_code is None or op_code is None else (dtype_code, op_code)


def combine_all(arena: Any, op: Any, parts: list[np.ndarray], out: np.ndarray) -> None:
    """op.combine_all(parts, out) of a direct algorithm: in C where the arena has the kernel and it takes
    the dtype and op (the same results as NumPy's, bit for bit), else NumPy's."""
    codes = kernel_codes(arena, out.dtype, op) if len(parts) > 1 else None
    if codes is None:
        op.combine_all(parts, out)
        return
    combine, (dtype, code) = kernel_module.combine, codes
    combine(dtype, code, out, parts[0], parts[1])
    for part in parts[2:]:
        combine(dtype, code, out, out, part)


def may_fail(op: Any) -> bool:
    """Whether `op` is a user's (it may raise on one rank only; a built-in op does not fail): then a rank
    that does not want the result still waits for every rank's reduced part before its call returns, so
    that a failure anywhere fails the call here too; and the C kernel never runs it."""
    return getattr(OPS.get(op.name), "fn", None) is not op.fn


def reduce_into(arena: Any, op: Any, parts: list[np.ndarray], outs: list[np.ndarray]) -> None:
    """outs[0] = parts[0] op parts[1] op ... in rank order, then copied into outs[1] if given.

    In C (kernel_module.reduce_into) where the arena has the kernel and it takes the dtype and op, else
    NumPy's. outs[0] must not overlap a part, unless it is the very array of parts[0] or parts[1] (the first
    combination reads both before it writes each element; with more parts, later ones must not be it);
    outs[1] may be any one of them (the rank's own part of its buffer, read in place and overwritten with
    the result once all were read).

    Args:
        arena: the arena (its kernel, if any).
        op: the reduction.
        parts: equal-length typed inputs, in rank order (at least two).
        outs: one or two equal-length typed outputs.
    """
    codes = kernel_codes(arena, outs[0].dtype, op)
    if codes is None or not kernel_module.reduce_into(*codes, tuple(parts), tuple(outs)):
        op.combine_all(parts, outs[0])
        if len(outs) == 2:
            outs[1][...] = outs[0]


def copy_bytes(arena: Any, dst: np.ndarray, src: np.ndarray) -> None:
    """dst[...] = src for byte views of one length: with the kernel's own copy where the arena has it (NumPy's
    goes through glibc's memcpy, whose speed depends on the two addresses on some CPUs: _native/copy.h)."""
    if arena.kernel is not None:
        kernel_module.copy(dst, src)
    else:
        dst[...] = src


def run_phases(call: Any) -> None:
    """Run a call cut into phases (the kernel's loops of pieces, src/tcoll/shm/pieces.h): from each point as many
    as the kernel goes (`call.run_kernel(done)`: how many are done), then the one it stopped at in Python
    (`call.run_phase(done)`: True where the call went on another way and is over), until `call.phases` are done.
    """
    done = 0
    while done < call.phases:
        done = call.run_kernel(done)
        if done < call.phases:
            if call.run_phase(done):
                return
            done += 1
