"""`tcoll.torch.ddp_hook`: a DDP comm hook that averages each gradient bucket through a persistent tcoll plan.

    model = DistributedDataParallel(net)                  # on a tcoll process group
    model.register_comm_hook(None, tcoll.torch.ddp_hook)  # state: the group DDP uses (None: the default group)

DDP hands the hook each bucket's flat gradient buffer once all its gradients
are ready. The hook keeps, per bucket index, a buffer of the bucket's size in
the group's shared memory (`comm.empty`) and a persistent all_reduce plan
(`comm.all_reduce_init`) over it. Each call divides the bucket by the world
size straight into that buffer (one pass: DDP averages, and the division is
the copy), runs the plan, which on one host reads every rank's buffer where
it lies instead of copying it into the arena and back out, and returns the
buffer: DDP copies the result from it into the parameters' gradients, as it
copies out of its own bucket without a hook. So the hook's one pass over the
bucket (the division into the buffer) stands for the ordinary call's two
(into the arena, and the result back out), and each call skips tcoll's
argument checks and algorithm choice. A bucket whose size or dtype changes
(DDP rebuilds its buckets after the first step) gets a new buffer and plan.
A sparse bucket (`nn.Embedding(sparse=True)`) takes torch's own allreduce
hook on the group.

The plan's fingerprint carries the bucket's size and dtype, so ranks whose
buckets differ get a `tcoll.MismatchError` from `backward()` on every rank,
not a hang. (DDP itself compares the parameters' shapes when it is made, and
every rank takes rank 0's bucket layout.)
"""

# No `from __future__ import annotations`: DDP's register_comm_hook compares the hook's annotations
# with dist.GradBucket and torch.futures.Future[torch.Tensor] themselves, and strings would not match.
import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from .tensors import np_view
from .work import held_calls, run_held

__all__ = ["ddp_hook", "BucketPlans", "plans_for", "tcoll_group"]


class BucketPlans:
    """One process group's bucket buffers and their all_reduce plans, by bucket index.

    Args:
        group: a tcoll process group (ProcessGroupTcoll).
    """

    def __init__(self, group: Any) -> None:
        self.comm = group.comm  # not the group: the group holds this (weakly) and must be free to go
        self._slots: dict[int, tuple[torch.Tensor, Callable[[], Any]]] = {}

    def reduce(self, index: int, grads: torch.Tensor) -> torch.Tensor:
        """The average over ranks of `grads` (bucket `index`'s flat buffer), in this group's buffer for it.

        Raises:
            MismatchError: the ranks' buckets at this point differ in size or dtype.
            TcollError: the group is closed, or a peer failed.
        """
        if held_calls:  # calls made before this one, still held (tcoll.torch.work), run first: the ranks' order
            run_held()
        slot = self._slots.get(index)
        if slot is None or slot[0].shape != grads.shape or slot[0].dtype != grads.dtype:
            slot = self._slots[index] = self._make(grads)
        buffer, run = slot
        torch.div(grads, self.comm.size, out=buffer)
        run()
        return buffer

    def _make(self, grads: torch.Tensor) -> tuple[torch.Tensor, Callable[[], Any]]:
        """A shared-memory buffer shaped like `grads` and the runner of a sum plan over it."""
        raw = torch.from_numpy(self.comm.empty(grads.numel() * grads.element_size(), "uint8"))
        buffer = raw.view(grads.dtype).view(grads.shape)
        return buffer, self.comm.all_reduce_init(np_view(buffer), "sum").runner()


_kept: "weakref.WeakKeyDictionary[Any, BucketPlans]" = weakref.WeakKeyDictionary()


def tcoll_group(state: Any) -> Any:
    """The tcoll process group `state` names (None: the default group).

    Raises:
        TypeError: it is not a tcoll process group.
    """
    from .process_group import ProcessGroupTcoll

    group = state if state is not None else dist.group.WORLD if dist.is_initialized() else None
    if not isinstance(group, ProcessGroupTcoll):
        what = "no default process group" if group is None else f"a {type(group).__name__} ({_backend(group)})"
        raise TypeError(f"tcoll.torch.ddp_hook needs the tcoll process group DDP uses as its state (None: the "
                        f"default group), and got {what}: make the group with backend 'tcoll' and register "
                        f"model.register_comm_hook(group, tcoll.torch.ddp_hook)")
    return group


def plans_for(group: Any) -> BucketPlans:
    """The BucketPlans of the tcoll process group `group`, made on first use."""
    plans = _kept.get(group)
    if plans is None or plans.comm is not group.comm:
        plans = _kept[group] = BucketPlans(group)
    return plans


def _backend(group: Any) -> str:
    """The backend name of a torch process group, for an error message."""
    try:
        return str(dist.get_backend(group))
    except Exception:  # noqa: BLE001 - not a registered group: its type says enough
        return "not a process group torch knows"


def ddp_hook(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook: the average over ranks of a gradient bucket, through a persistent tcoll plan.

    Register it with `model.register_comm_hook(group, tcoll.torch.ddp_hook)`.

    Args:
        state: the tcoll process group DDP uses, or None for the default group.
        bucket: DDP's gradient bucket.

    Returns:
        A completed Future holding the averaged gradients (a tensor in the group's shared memory).

    Raises:
        TypeError: `state` (or the default group) is not a tcoll process group.
        MismatchError: the ranks' buckets differ (size or dtype).
    """
    group, grads = tcoll_group(state), bucket.buffer()
    if grads.layout != torch.strided:  # sparse gradients: the group's own all_reduce gathers their entries
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        return allreduce_hook(group, bucket)
    averaged = plans_for(group).reduce(bucket.index(), grads)
    future = torch.futures.Future()
    future.set_result(averaged)
    return future
