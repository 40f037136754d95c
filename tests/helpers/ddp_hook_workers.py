"""What the ranks of the `tcoll.torch.ddp_hook` tests run (module-level, so torch.multiprocessing can spawn them).

DDP with the hook trains as one process does (tests/helpers/torch_workers.py:
`reference`), the hook's buckets are the averages NumPy computes, and ranks
whose buckets or models differ get a named error instead of a hang.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

import tcoll
import tcoll.torch

from . import torch_workers as tw


class Bucket:
    """A stand-in for dist.GradBucket (which Python cannot make): the two methods the hook calls."""

    def __init__(self, index: int, tensor: torch.Tensor) -> None:
        self._index, self._tensor = index, tensor

    def index(self) -> int:
        return self._index

    def buffer(self) -> torch.Tensor:
        return self._tensor


def rank_data(r: int, count: int, dtype: torch.dtype, salt: int) -> np.ndarray:
    """Rank r's gradients for a direct hook call: small integers, exact in float32 and float64."""
    values = (np.arange(count, dtype=np.int64) * 7 + r * 13 + salt) % 11 - 5
    return values.astype(np.float32 if dtype == torch.float32 else np.float64)


def check_direct_calls(rank: int, size: int) -> None:
    """The hook's result is the ranks' mean (NumPy): small, large and sparse buckets; each index keeps its buffer."""
    first: dict[int, int] = {}
    for step in range(3):
        for index, (count, dtype) in enumerate([(1, torch.float32), (1000, torch.float64), (300_000, torch.float32)]):
            grads = torch.from_numpy(rank_data(rank, count, dtype, step + index))
            want = np.mean([rank_data(r, count, dtype, step + index) for r in range(size)], axis=0)
            got = tcoll.torch.ddp_hook(None, Bucket(index, grads.clone())).wait()
            assert got.dtype == dtype and got.shape == (count,), (got.dtype, got.shape)
            np.testing.assert_allclose(got.numpy(), want, rtol=1e-6, err_msg=f"bucket {index} step {step}")
            assert first.setdefault(index, got.data_ptr()) == got.data_ptr(), "a bucket's buffer was made anew"
    grads = torch.from_numpy(rank_data(rank, 77, torch.float64, 9))  # bucket 0 changes size: a new buffer
    got = tcoll.torch.ddp_hook(dist.group.WORLD, Bucket(0, grads)).wait()
    np.testing.assert_allclose(got.numpy(), np.mean([rank_data(r, 77, torch.float64, 9) for r in range(size)], 0))
    dense = [torch.zeros(6, 2, dtype=torch.float64) for _ in range(size)]  # a sparse bucket (nn.Embedding)
    for r, rows in enumerate(dense):
        rows[r % 6] = r + 1.0
        rows[5] = 2.0 * r
    got = tcoll.torch.ddp_hook(None, Bucket(3, dense[rank].to_sparse())).wait()
    assert torch.allclose(got.to_dense(), torch.stack(dense).mean(0)), (got, dense)


def check_held_calls_run_first(rank: int, size: int) -> None:
    """A call held before the hook (async_op=True, not yet waited for) runs before the hook's, on every rank.

    Rank 0 polls its Work, which runs the call there at once; on the others it
    is still held when the hook comes, and must run before the hook's plan.
    """
    t = torch.full((4,), float(rank))
    work = dist.all_reduce(t, async_op=True)
    if rank == 0:
        work.is_completed()
    got = tcoll.torch.ddp_hook(None, Bucket(7, torch.full((5,), float(rank)))).wait()
    work.wait()
    assert torch.equal(t, torch.full((4,), float(sum(range(size))))), t
    assert torch.allclose(got, torch.full((5,), sum(range(size)) / size)), got


def recording(seen: list[tuple[int, int]]) -> Any:
    """The hook, noting each bucket's (index, elements) in `seen`."""
    def hook(state, bucket):  # type: ignore[no-untyped-def] # DDP rejects annotations that are strings
        seen.append((bucket.index(), bucket.buffer().numel()))
        return tcoll.torch.ddp_hook(state, bucket)

    return hook


def training(rank: int, size: int, port: int) -> None:
    """DDP with the hook (default, tiny and mid-sized buckets, gradients as bucket views) against one process."""
    tw.init(rank, size, port)
    check_direct_calls(rank, size)
    check_held_calls_run_first(rank, size)
    want_grads, want_weights = tw.reference(size, [tw.STEPS] * size)
    variants: dict[str, dict[str, Any]] = {
        "default buckets": {},
        "tiny buckets": {"bucket_cap_mb": 0.0001},  # about one parameter per bucket: sizes 3 to 72
        "mid buckets": {"bucket_cap_mb": 0.0005},  # several parameters per bucket
        "gradient_as_bucket_view": {"gradient_as_bucket_view": True, "bucket_cap_mb": 0.0001},
    }
    for name, kwargs in variants.items():
        seen: list[tuple[int, int]] = []
        grads, weights = tw.train_ddp(rank, size, hook=recording(seen), **kwargs)
        for step, (g, w) in enumerate(zip(grads, want_grads, strict=True)):
            tw.close(g, w, f"{name}: gradients of step {step}")
        tw.close(weights, want_weights, f"{name}: final weights")
        last = dict(seen)  # each bucket's size at its last call
        if name != "default buckets":
            assert len(last) >= 2 and len(set(last.values())) >= 2, f"{name}: buckets {last}"
    dist.destroy_process_group()


def mismatches(rank: int, size: int, port: int, report: dict[str, Any] | None = None) -> None:
    """Buckets that differ raise MismatchError on every rank; a group that is not tcoll's is a TypeError."""
    tw.init(rank, size, port)
    bigger = rank == size - 1
    try:
        tcoll.torch.ddp_hook(None, Bucket(5, torch.ones(300 if bigger else 200)))
    except tcoll.MismatchError as exc:
        assert "rank" in str(exc), str(exc)
    else:
        raise AssertionError(f"rank {rank}: buckets of 200 and 300 elements were reduced without an error")
    after = torch.full((3,), float(rank + 1))
    dist.all_reduce(after)  # the group goes on
    assert torch.equal(after, torch.full((3,), size * (size + 1) / 2)), after
    from torch.nn.parallel import DistributedDataParallel as DDP

    gloo = dist.new_group(list(range(size)), backend="gloo")
    model = DDP(torch.nn.Linear(3, 2), process_group=gloo)
    model.register_comm_hook(gloo, tcoll.torch.ddp_hook)
    try:
        model(torch.ones(2, 3)).sum().backward()
    except TypeError as exc:
        assert "tcoll.torch.ddp_hook" in str(exc) and "gloo" in str(exc), str(exc)
    else:
        raise AssertionError("the hook ran on a gloo group")
    dist.barrier()
    dist.destroy_process_group(gloo)
    other_model(rank, size)


def other_model(rank: int, size: int) -> None:
    """One rank's model is larger: DDP's own check raises there; the others get PeerLostError once it leaves.

    The hook is never reached (DDP compares the parameters' shapes when it is
    made); what matters is that no rank hangs.
    """
    from torch.nn.parallel import DistributedDataParallel as DDP

    odd = rank == size - 1
    start = time.monotonic()
    try:
        model = DDP(torch.nn.Sequential(torch.nn.Linear(6, 13 if odd else 12), torch.nn.Linear(13 if odd else 12, 3)))
        model.register_comm_hook(None, tcoll.torch.ddp_hook)
        model(torch.ones(2, 6)).sum().backward()
    except RuntimeError as exc:
        assert odd, f"rank {rank}: {type(exc).__name__}: {exc}"
        assert "not to match" in str(exc), str(exc)
        dist.destroy_process_group()  # what a failing rank's exit does: the others learn it is gone
        return
    except tcoll.PeerLostError as exc:
        assert not odd and f"rank {size - 1}" in str(exc), str(exc)
        assert time.monotonic() - start < 30, time.monotonic() - start
        dist.destroy_process_group()
        return
    raise AssertionError(f"rank {rank}: models of different sizes trained")
