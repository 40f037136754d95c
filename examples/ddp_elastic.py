"""DDP training that goes on after losing a rank: catch, revoke, shrink the group, wrap DDP again, finish.

    python examples/ddp_elastic.py --check            # starts 3 ranks itself (tcoll.spawn, keep_going=True)
    tcoll run -n 3 --keep-going examples/ddp_elastic.py --check   # exits 137: a rank was killed

A small float64 model trains under DistributedDataParallel on a "tcoll"
group, on global batches of --batch-size rows that the ranks share evenly.
At the start of step --die-at, rank --victim (default: the last) SIGKILLs
itself, as a crashed or preempted process would. The others' backward
raises tcoll.PeerLostError within about a second (DDP's all_reduce waited on
the dead rank). Each survivor then:

1. revokes the group (`tcoll.torch.revoke`), so that every survivor leaves
   its calls on it, also one that was not waiting on the dead rank;
2. shrinks it (`tcoll.torch.shrink_group`): a new tcoll group of the
   survivors, renumbered 0..n-1 in their old order;
3. wraps the same module in a new DDP on the new group. DDP cannot move to
   another group: its reducer keeps the group it was built with, so the old
   DDP is dropped and a new one built (which broadcasts the new rank 0's
   weights, so every survivor starts from the same state);
4. takes the new rank 0's step count (a survivor may have finished the step
   that failed elsewhere: the group then goes on from rank 0's state), and
   trains on, each survivor taking a larger share of every batch.

Rank 0 prints the final loss. With --check it also trains the same model in
this one process on whole batches: data-parallel SGD with averaged gradients
over equal shares is the same computation whatever the number of ranks, so
the weights must match to 1e-9. The optimizer is plain SGD, which keeps no
state; one with state (momentum, Adam) would need that state made the same on
the survivors too (broadcast from the new rank 0).

Without a launcher, this script starts the ranks with
`tcoll.spawn(..., keep_going=True)` and exits 0 when the victim alone died
and the others finished. Under a launcher the launcher must let the
survivors run on (`tcoll run --keep-going`); a plain `tcoll run` stops them
when the victim dies, which is its fail-fast default.
"""

from __future__ import annotations

import argparse
import gc
import os
import signal
import socket
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import tcoll
import tcoll.torch

FEATURES, HIDDEN, OUTPUTS = 8, 32, 2


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-n", "--ranks", type=int, default=3, help="ranks to start (without a launcher)")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--die-at", type=int, default=15, help="the step at whose start the victim dies")
    parser.add_argument("--victim", type=int, default=-1, help="the rank that dies (default: the last)")
    parser.add_argument("--batch-size", type=int, default=48, help="global batch; divides by every rank count")
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--check", action="store_true", help="compare with training in one process")
    return parser.parse_args(argv)


_TRUE = torch.randn(FEATURES, OUTPUTS, generator=torch.Generator().manual_seed(1234), dtype=torch.float64)


def batch(step: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Global batch `step` (`rows` rows) of a synthetic regression task, the same on every rank."""
    g = torch.Generator().manual_seed(step)
    x = torch.randn(rows, FEATURES, generator=g, dtype=torch.float64)
    return x, torch.tanh(x @ _TRUE) + 0.05 * torch.randn(rows, OUTPUTS, generator=g, dtype=torch.float64)


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(FEATURES, HIDDEN), torch.nn.Tanh(),
                               torch.nn.Linear(HIDDEN, OUTPUTS)).double()


def step_on(model: torch.nn.Module, opt: torch.optim.Optimizer, step: int, batch_size: int, rank: int,
            size: int) -> float:
    """One SGD step on this rank's share of global batch `step`; returns the share's loss."""
    x, y = batch(step, batch_size)
    share = batch_size // size
    rows = slice(rank * share, (rank + 1) * share)
    opt.zero_grad()
    loss = torch.nn.functional.mse_loss(model(x[rows]), y[rows])
    loss.backward()
    opt.step()
    return loss.item()


def train(args: argparse.Namespace) -> None:
    """One rank's part (its default group is up): DDP training that survives the victim's death."""
    victim = args.victim % dist.get_world_size()
    module = make_model()
    opt = torch.optim.SGD(module.parameters(), lr=args.lr)
    group = dist.group.WORLD
    model = DDP(module, process_group=group)
    step, events = 0, []
    while step < args.steps:
        if step == args.die_at and dist.get_rank() == victim:
            os.kill(os.getpid(), signal.SIGKILL)  # as a crash would: no exit handler runs
        try:
            step_on(model, opt, step, args.batch_size, dist.get_rank(group), dist.get_world_size(group))
            step += 1
            continue
        except (tcoll.PeerLostError, tcoll.RevokedError) as exc:
            tcoll.torch.revoke(group)  # the other survivors leave their calls on the old group too
            error = type(exc).__name__
        # (out of the except block: its traceback, which holds the old DDP, is gone)
        dead = tcoll.torch.failed(group)
        group = tcoll.torch.shrink_group(group)  # collective over the survivors
        del model  # DDP is bound to its group: drop it (its hooks go with it), wrap the same module anew
        gc.collect()  # (the failed step's error and frames may hold it in a cycle: its hooks must go now)
        model = DDP(module, process_group=group)  # (which gives every survivor the new rank 0's weights)
        where = torch.tensor([step])
        dist.broadcast(where, group_src=0, group=group)  # go on from the new rank 0's step
        step = int(where.item())
        events.append(f"step {step}: {error}; rank(s) {dead} dead, going on with "
                      f"{dist.get_world_size(group)} ranks (this rank is now {dist.get_rank(group)})")
    if dist.get_rank(group) == 0:
        report(args, module, events, dist.get_world_size(group))
    dist.destroy_process_group()


def final_loss(module: torch.nn.Module, args: argparse.Namespace) -> float:
    """The model's loss over every batch it trained on."""
    with torch.no_grad():
        batches = [batch(step, args.batch_size) for step in range(args.steps)]
        return sum(torch.nn.functional.mse_loss(module(x), y).item() for x, y in batches) / args.steps


def report(args: argparse.Namespace, module: torch.nn.Module, events: list[str], size: int) -> None:
    """Rank 0's output: what happened, the final loss, and with --check the comparison with one process."""
    for event in events:
        print(event)
    print(f"trained {args.steps} steps, finished on {size} ranks; final loss {final_loss(module, args):.6f}")
    if not args.check:
        return
    single = make_model()
    opt = torch.optim.SGD(single.parameters(), lr=args.lr)
    for step in range(args.steps):
        step_on(single, opt, step, args.batch_size, 0, 1)
    diff = max((a - b).abs().max().item() for a, b in zip(module.parameters(), single.parameters(), strict=True))
    print(f"single process: final loss {final_loss(single, args):.6f}; weights "
          f"{'match' if diff <= 1e-9 else 'DO NOT match'} single-process training (largest difference {diff:.1e})")
    if diff > 1e-9:
        raise SystemExit(1)


def rank_main(comm: tcoll.Communicator, args: argparse.Namespace) -> None:
    """A rank started by tcoll.spawn: its torch default group meets on MASTER_ADDR/PORT (set by main)."""
    dist.init_process_group("tcoll", rank=comm.rank, world_size=comm.size)
    train(args)


def main() -> None:
    args = parse()
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # under a launcher: this process is one rank
        dist.init_process_group("tcoll")
        train(args)
        return
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if "MASTER_PORT" not in os.environ:
        with socket.socket() as probe:  # a port free now
            probe.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(probe.getsockname()[1])
    victim = args.victim % args.ranks
    try:
        tcoll.spawn(rank_main, args.ranks, (args,), keep_going=True)
    except tcoll.SpawnError as exc:  # raised once every rank ended: the victim's death is expected
        print(f"rank {', '.join(f'{r}: {why}' for r, why in sorted(exc.failures.items()))}")
        if sorted(exc.failures) != [victim] or "SIGKILL" not in exc.failures[victim]:
            sys.exit(1)
        return
    sys.exit("the victim did not die (is --die-at below --steps?)")


if __name__ == "__main__":
    main()
