"""The persistent tcoll plans the backend keeps for the all_reduce of small tensors.

Checking and binding a call costs more than a small call itself, and DDP's
buckets and a latency loop reduce the same tensors again and again. So the
backend keeps, per small tensor, a persistent plan of its all_reduce
(`comm.all_reduce_init`), and runs the plan's runner when the tensor comes
again. A plan holds its tensor's memory, so only small tensors get one, at
most KEPT of them; a plan is found by address, element count, dtype and op,
which only the same memory can match while the plan lives. Every run still
takes its sequence number and the ranks still compare its fingerprint.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..comm.communicator import Communicator
from .tensors import np_view

__all__ = ["AllReducePlans", "KEPT", "PLAN_BYTES"]

KEPT, PLAN_BYTES = 32, 64 << 10  # plans kept, and the largest tensor that gets one


class AllReducePlans:
    """One process group's kept all_reduce plans.

    Args:
        comm: the group's communicator.
    """

    def __init__(self, comm: Communicator) -> None:
        self.comm = comm
        self._runs: dict[tuple[int, int, torch.dtype, str], Callable[[], Any]] = {}

    def run(self, t: torch.Tensor, name: str) -> None:
        """All-reduce `t` (contiguous, a dtype tcoll reduces as torch does) with op `name`, blocking."""
        run = self._runs.get((t.data_ptr(), t.numel(), t.dtype, name))
        if run is None:
            run = self._make(t, name)
        run()

    def _make(self, t: torch.Tensor, name: str) -> Callable[[], Any]:
        """What runs `t`'s all_reduce: a new plan, kept if `t` is small, or the ordinary call."""
        comm = self.comm
        if t.numel() * t.element_size() > PLAN_BYTES:
            return lambda: comm.all_reduce(np_view(t), name)
        try:
            run = comm.all_reduce_init(np_view(t), name).runner()
        except Exception:  # noqa: BLE001 - the ordinary call raises it, and tells the other ranks
            return lambda: comm.all_reduce(np_view(t), name)  # (a plan's checks are local: they would wait)
        if len(self._runs) >= KEPT:
            self._runs.clear()
        self._runs[(t.data_ptr(), t.numel(), t.dtype, name)] = run
        return run
