"""What the ranks of the torch survival tests run: a torch "tcoll" group loses a rank to SIGKILL; the others go on.

Each rank is a `tcoll.spawn(keep_going=True)` process that opens its own
torch default group (backend "tcoll", through MASTER_ADDR/PORT); the spawn's
communicator only gives it its rank. Rank r's data is `value(r, ...)`, r its
rank before the shrink, so a result computed over the wrong members differs
from NumPy's.
"""

from __future__ import annotations

import datetime
import os
import time
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from helpers.survivors import die

import tcoll
import tcoll.torch


def value(old: int, count: int, salt: int = 0) -> np.ndarray:
    """Rank `old`'s data: distinct per rank, exact in float64 sums."""
    return (np.arange(count, dtype=np.float64) * 3 + 100 * old + salt) % 997


def _init(rank: int, size: int, port: int) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("tcoll", rank=rank, world_size=size, timeout=datetime.timedelta(seconds=60))


def _blocked_call(rank: int, waiter: int, peer: int) -> None:
    """The call that the death interrupts: rank `waiter` receives from the live `peer` (which never sends:
    only the revoke gets it out); every other rank all-reduces, which waits on the dead one."""
    if rank == waiter:
        dist.recv(torch.zeros(3), src=peer)
    else:
        dist.all_reduce(torch.from_numpy(value(rank, 8)))


def shrink_after_death(comm: tcoll.Communicator, port: int, victim: int, waiter: int = -1,
                       peer: int = -1) -> dict[str, Any]:
    """Rank `victim` dies before the second call; the others catch, revoke, shrink_group and check the new group.

    Rank `waiter` (if any) is then in a receive from the live rank `peer`, the others in an all_reduce.

    Returns:
        What this survivor saw: the error (type, text, seconds), its ranks before and after, what failed() said.
    """
    rank, size = comm.rank, comm.size
    _init(rank, size, port)
    first = torch.from_numpy(value(rank, 8))
    dist.all_reduce(first)  # every rank alive: the group works
    np.testing.assert_array_equal(first.numpy(), np.sum([value(r, 8) for r in range(size)], axis=0))
    if rank == victim:
        die()
    began = time.monotonic()
    seen: dict[str, Any] = {"error": None, "old_rank": rank, "run_id": os.environ.get("TCOLL_RUN_ID")}
    try:
        _blocked_call(rank, waiter, peer)
    except Exception as exc:  # noqa: BLE001 - which error torch surfaces is what the test checks
        seen.update(error=type(exc).__name__, after_s=time.monotonic() - began, text=str(exc)[:300])
    tcoll.torch.revoke()
    new = tcoll.torch.shrink_group()
    seen["failed"] = tcoll.torch.failed()  # known dead in the old group (asked after the shrink: all know it)
    survivors = [r for r in range(size) if r != victim]
    seen.update(rank=dist.get_rank(new), size=dist.get_world_size(new), ranks=dist.get_process_group_ranks(new),
                global_rank=dist.get_rank(), backend=dist.get_backend(new))
    check_group(new, survivors)
    try:  # the default group is still the old, revoked one
        dist.all_reduce(torch.zeros(2))
    except tcoll.RevokedError:
        seen["default_revoked"] = True
    seen["agree"] = tcoll.torch.agree(0b110 if dist.get_rank(new) == 0 else 0b011, new)
    old = dist.group.WORLD
    dist.destroy_process_group(new)  # closes the shrunk group's communicator, and the old one it replaced
    seen["old_closed"] = old.comm.closed
    dist.destroy_process_group()
    return seen


def check_group(group: Any, olds: list[int]) -> None:
    """all_reduce, broadcast and all_gather (blocking and async) on `group` against NumPy; olds[r]: rank r's old rank.

    Raises:
        AssertionError: a result differs from NumPy's.
    """
    me = dist.get_rank(group)
    rows = [value(old, 40) for old in olds]
    x = torch.from_numpy(rows[me].copy())
    dist.all_reduce(x, group=group)
    np.testing.assert_array_equal(x.numpy(), np.sum(rows, axis=0))
    m = torch.from_numpy(rows[me].copy())
    dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group, async_op=True).wait()
    np.testing.assert_array_equal(m.numpy(), np.max(rows, axis=0))
    big = torch.from_numpy(np.tile(rows[me], 2000))  # 640 KB: the pipelined paths
    dist.all_reduce(big, group=group)
    np.testing.assert_array_equal(big.numpy(), np.tile(np.sum(rows, axis=0), 2000))
    root = len(olds) - 1
    b = torch.from_numpy(rows[me].copy())
    dist.broadcast(b, group_src=root, group=group)
    np.testing.assert_array_equal(b.numpy(), rows[root])
    out = [torch.zeros(40, dtype=torch.float64) for _ in olds]
    dist.all_gather(out, torch.from_numpy(rows[me]), group=group)
    np.testing.assert_array_equal(torch.stack(out).numpy(), np.stack(rows))
    flat = torch.zeros(40 * len(olds), dtype=torch.float64)
    dist.all_gather_single(flat, torch.from_numpy(rows[me]), group=group)
    np.testing.assert_array_equal(flat.numpy(), np.concatenate(rows))
