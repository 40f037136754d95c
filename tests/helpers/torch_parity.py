"""What the ranks of tests/torch/test_parity.py run: the behaviours torch's own suite checks on gloo.

`run_all` runs every check on each rank and writes, per rank, which checks
failed and why; the tests read those files, one test per check, so each
behaviour passes or fails on its own. Checks that leave a group unusable
(timeouts) use a group of their own and run last.
"""

from __future__ import annotations

import datetime
import json
import os
import re
import time
import traceback
from collections.abc import Callable

import torch
import torch.distributed as dist

import tcoll.torch

TORCH_TIMEOUT = re.compile(" (Timed out|closed|timeout) ")  # what torch's distributed_test.py expects


def check_all_gather_coalesced(rank: int, size: int) -> None:
    """Rank r's inputs[i] lands in outputs[r][i] (torch's [rank][i] layout), for tensors of several shapes."""
    def inputs(r: int) -> list[torch.Tensor]:
        return [torch.full((2,), float(r)), torch.arange(6.0).reshape(3, 2) + r, torch.zeros(0)]

    mine = inputs(rank)
    outputs = [[torch.empty_like(t) for t in mine] for _ in range(size)]
    dist.all_gather_coalesced(outputs, mine)
    for r in range(size):
        for got, want in zip(outputs[r], inputs(r), strict=True):
            assert torch.equal(got, want), f"outputs[{r}]: {got} != {want}"


def _sparse(rank: int, size: int, sparse_dims: int, dense_dims: int) -> torch.Tensor:
    """torch's simple_sparse_reduce_tests input: entries 0..rank of the first sparse dimension."""
    indices = torch.arange(rank + 1).reshape(1, rank + 1)
    for _ in range(sparse_dims - 1):
        indices = torch.cat((indices, torch.zeros(1, rank + 1, dtype=torch.int64)))
    shape = [size] * sparse_dims + [2] * dense_dims
    values = torch.ones([rank + 1] + [2] * dense_dims) * (rank + 1)
    return torch.sparse_coo_tensor(indices, values, shape)


def check_sparse_all_reduce(rank: int, size: int) -> None:
    """SUM of sparse COO tensors with 1-3 sparse and 0-2 dense dimensions equals the local sum of all ranks'."""
    for sparse_dims, dense_dims in ((1, 0), (2, 0), (3, 0), (1, 1), (1, 2), (2, 1)):
        t = _sparse(rank, size, sparse_dims, dense_dims)
        dist.all_reduce(t)
        want = _sum_of(size, sparse_dims, dense_dims)
        assert t.is_sparse and torch.equal(t.to_dense(), want.to_dense()), f"{sparse_dims}/{dense_dims}: {t}"
    bad = torch.sparse_coo_tensor(torch.zeros(1, 1, dtype=torch.int64), torch.ones(1), (size + rank,))
    try:
        dist.all_reduce(bad)
    except ValueError as exc:
        assert "differs" in str(exc), exc
    else:
        raise AssertionError("sparse tensors of different shapes were summed")


def _sum_of(size: int, sparse_dims: int, dense_dims: int) -> torch.Tensor:
    total = _sparse(0, size, sparse_dims, dense_dims)
    for r in range(1, size):
        total = total + _sparse(r, size, sparse_dims, dense_dims)
    return total.coalesce()


class _Bag(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embedding = torch.nn.Embedding(10, 3, sparse=True)
        self.head = torch.nn.Linear(3, 1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.embedding(ids)).sum()


def check_ddp_sparse_embedding(rank: int, size: int) -> None:
    """DDP with nn.Embedding(sparse=True): after a step, the weights equal training on all ranks' data at once."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    def ids(r: int) -> torch.Tensor:
        return torch.tensor([r, r + 1, 2 * r % 10])

    model = DDP(_Bag())
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    model(ids(rank)).backward()
    assert model.module.embedding.weight.grad.is_sparse
    opt.step()
    reference = _Bag()
    for r in range(size):  # DDP averages the gradients: the mean of the ranks' losses
        (reference(ids(r)) / size).backward()
    torch.optim.SGD(reference.parameters(), lr=0.5).step()
    for got, want in zip(model.module.parameters(), reference.parameters(), strict=True):
        assert torch.allclose(got, want, atol=1e-6), f"{got} != {want}"


def check_split_group(rank: int, size: int) -> None:
    """tcoll.torch.split_group: disjoint groups, a rank in none; collectives and destroy work on them."""
    group = tcoll.torch.split_group(split_ranks=[[0, 2], [1]] if size == 3 else [[0], [1]])
    if rank >= 3:
        assert group is None
        return
    members = [[0, 2], [1], [0, 2]][rank] if size == 3 else [[0], [1]][rank]
    assert group is not None and group.size() == len(members) and dist.get_rank(group) == members.index(rank)
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t, group=group)
    assert t.item() == sum(m + 1 for m in members), t
    dist.destroy_process_group(group)


def check_subgroups_by_enumeration(rank: int, size: int) -> None:
    """new_subgroups_by_enumeration: each rank's subgroup reduces its members only; destroying them works."""
    lists = [[0, 2], [1]]
    cur, subgroups = dist.new_subgroups_by_enumeration(ranks_per_subgroup_list=lists)
    mine = lists[0] if rank in lists[0] else lists[1]
    assert len(subgroups) == 2 and cur.size() == len(mine) and dist.get_rank(cur) == mine.index(rank)
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t, group=cur)
    assert t.item() == sum(m + 1 for m in mine), t
    for group in subgroups:
        dist.destroy_process_group(group)


def check_avg_float16(rank: int, size: int) -> None:
    """AVG of float16 (and bfloat16) whose sum overflows but whose mean is representable: all_reduce, reduce_scatter."""
    for dtype, big in ((torch.float16, 60000.0), (torch.bfloat16, 3.0e38)):
        t = torch.full((5,), big, dtype=dtype)
        dist.all_reduce(t, op=dist.ReduceOp.AVG)
        assert torch.equal(t, torch.full((5,), big, dtype=dtype)), t
        out = torch.empty(2, dtype=dtype)
        dist.reduce_scatter_tensor(out, torch.full((2 * size,), big, dtype=dtype), op=dist.ReduceOp.AVG)
        assert torch.equal(out, torch.full((2,), big, dtype=dtype)), out
    t = torch.tensor([1.0, 2.0, 3.0], dtype=torch.float16) * (rank + 1)
    dist.all_reduce(t, op=dist.ReduceOp.AVG)
    mean = sum(range(1, size + 1)) / size
    assert torch.allclose(t.float(), torch.tensor([1.0, 2.0, 3.0]) * mean, rtol=1e-3), t


def check_timeout_message(rank: int, size: int) -> None:
    """A barrier that times out after 2 s says " Timed out " as torch expects, and keeps tcoll's detail."""
    group = dist.new_group(list(range(size)), timeout=datetime.timedelta(seconds=2))
    if rank == 0:
        start = time.monotonic()
        try:
            dist.barrier(group)
        except Exception as exc:  # noqa: BLE001 - torch's test catches any exception
            assert TORCH_TIMEOUT.search(str(exc)), str(exc)
            assert "still waiting on rank" in str(exc) and isinstance(exc, tcoll.TimeoutError), str(exc)
            assert time.monotonic() - start >= 1.9
        else:
            raise AssertionError("a barrier of one rank did not time out")


def check_wait_timeout(rank: int, size: int) -> None:
    """Work.wait(timeout) with async_op=True (collectives run blocking): raises after that timeout, not the group's."""
    group = dist.new_group(list(range(size)), timeout=datetime.timedelta(seconds=30))
    if rank == 0:
        start = time.monotonic()
        try:
            work = dist.all_reduce(torch.ones(4), group=group, async_op=True)
            work.wait(datetime.timedelta(seconds=1))
        except Exception as exc:  # noqa: BLE001
            assert TORCH_TIMEOUT.search(str(exc)), str(exc)
        else:
            raise AssertionError("an all_reduce of one rank did not time out")
        took = time.monotonic() - start
        assert 0.9 <= took < 10, f"wait(1 s) took {took:.1f} s"


CHECKS: list[Callable[[int, int], None]] = [
    check_all_gather_coalesced, check_sparse_all_reduce, check_ddp_sparse_embedding, check_split_group,
    check_subgroups_by_enumeration, check_avg_float16, check_timeout_message, check_wait_timeout]


def run_all(rank: int, size: int, port: int, out_dir: str) -> None:
    """Every check, each followed by a barrier of the default group; failures are recorded, not raised."""
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("tcoll", rank=rank, world_size=size, timeout=datetime.timedelta(seconds=60))
    failures: dict[str, str] = {}
    for check in CHECKS:
        try:
            check(rank, size)
        except Exception:  # noqa: BLE001 - recorded for the test of this check
            failures[check.__name__] = traceback.format_exc()[-3000:]
        dist.barrier()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as handle:
        json.dump(failures, handle)
    dist.destroy_process_group()
