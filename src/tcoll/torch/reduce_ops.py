"""torch's reduce ops as tcoll's: which op name, premultiplication, integer average and wider dtype each takes."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from . import BACKEND_NAME

__all__ = ["OP_NAMES", "SIMPLE_OPS", "HASH_IS_VALUE", "AVG_IN", "reduction"]

_RedOp = dist.ReduceOp.RedOpType
OP_NAMES = {
    _RedOp.SUM: "sum", _RedOp.PRODUCT: "prod", _RedOp.MIN: "min", _RedOp.MAX: "max",
    _RedOp.BAND: "band", _RedOp.BOR: "bor", _RedOp.BXOR: "bxor", _RedOp.AVG: "avg", _RedOp.PREMUL_SUM: "sum",
}
# The ops (by value: hashing torch's enum is slow) tcoll reduces as torch means them, with no extra step.
SIMPLE_OPS = {k.value: v for k, v in OP_NAMES.items() if k not in (_RedOp.PREMUL_SUM, _RedOp.AVG)}
# A ReduceOp hashes to its op's value in torch 2.13, a third of the cost of reading .op.value; used only if so.
HASH_IS_VALUE = all(hash(dist.ReduceOp(k)) == k.value for k in OP_NAMES if k != _RedOp.PREMUL_SUM) and \
    hash(dist._make_nccl_premul_sum(2.0)) == _RedOp.PREMUL_SUM.value
AVG_IN = {torch.float16: torch.float32, torch.bfloat16: torch.float64}  # where an average cannot overflow


def reduction(reduce_op: Any, dtype: torch.dtype) -> tuple[str, Any, bool, torch.dtype | None]:
    """(tcoll op name, premultiplication factor or None, integer average, dtype to reduce in or None)
    for a torch ReduceOp on `dtype`.

    The average of float16 (bfloat16) is taken in float32 (float64) and
    rounded back: their sum overflows long before their mean does.
    """
    kind = getattr(reduce_op, "op", reduce_op)
    name = OP_NAMES.get(kind)
    if name is None:
        raise ValueError(f"{BACKEND_NAME}: reduce op {kind} is not supported")
    factor = getattr(reduce_op, "factor", None) if kind == _RedOp.PREMUL_SUM else None
    int_avg = False
    if name == "avg" and not (dtype.is_floating_point or dtype.is_complex):
        if dtype == torch.bool:
            raise TypeError(f"{BACKEND_NAME}: ReduceOp.AVG does not apply to torch.bool tensors")
        name, int_avg = "sum", True
    return name, factor, int_avg, AVG_IN.get(dtype) if name == "avg" else None
