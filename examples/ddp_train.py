"""Train a small model with DistributedDataParallel on the tcoll backend.

    tcoll run -n 4 examples/ddp_train.py
    torchrun --nproc-per-node 4 examples/ddp_train.py

Synthetic regression data (a noisy linear map through a tanh) is cut into
global batches of --batch-size rows; each rank trains on its share of every
batch and DDP averages the gradients through the "tcoll" process group.
Rank 0 prints the loss of each epoch, averaged over the ranks. With
--check, rank 0 then trains the same model in this one process on whole
batches and checks that the weights match (data-parallel SGD with averaged
gradients is the same computation). The backend is registered by the
`torch.backends` entry point that installing tcoll adds, so no tcoll import
is needed.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

FEATURES, HIDDEN, OUTPUTS, SAMPLES = 16, 64, 4, 2048


def make_data(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and targets of the synthetic task, the same on every rank."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(SAMPLES, FEATURES, generator=g)
    w = torch.randn(FEATURES, OUTPUTS, generator=g)
    return x, torch.tanh(x @ w) + 0.05 * torch.randn(SAMPLES, OUTPUTS, generator=g)


def make_model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(FEATURES, HIDDEN), torch.nn.ReLU(), torch.nn.Linear(HIDDEN, OUTPUTS))


def train(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, args: argparse.Namespace, rank: int = 0,
          world: int = 1) -> list[float]:
    """SGD over the global batches; this rank takes rows [rank * b, (rank + 1) * b) of each. Returns epoch losses."""
    opt = torch.optim.SGD(model.parameters(), lr=args.lr)
    share = args.batch_size // world
    losses = []
    for _ in range(args.epochs):
        total = torch.zeros(1)
        for start in range(0, SAMPLES, args.batch_size):
            rows = slice(start + rank * share, start + (rank + 1) * share)
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x[rows]), y[rows])
            loss.backward()
            opt.step()
            total += loss.detach()
        if world > 1:
            dist.all_reduce(total, op=dist.ReduceOp.AVG)  # the mean over ranks of the per-rank losses
        losses.append(total.item() / (SAMPLES // args.batch_size))
    return losses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=64, help="global batch; divides by the number of ranks")
    parser.add_argument("--lr", type=float, default=0.2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--check", action="store_true", help="compare with training in one process")
    parser.add_argument("--backend", default="tcoll", help="torch.distributed backend (gloo, to compare)")
    args = parser.parse_args()

    dist.init_process_group(args.backend)  # rank, size and rendezvous from the launcher's environment
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.batch_size % world:
        parser.error(f"--batch-size {args.batch_size} does not divide by {world} ranks")
    x, y = make_data(args.seed)
    model = DDP(make_model(args.seed))
    started = time.perf_counter()
    losses = train(model, x, y, args, rank, world)
    elapsed = time.perf_counter() - started
    if rank == 0:
        for epoch, loss in enumerate(losses, 1):
            print(f"epoch {epoch}: loss {loss:.6f}")
        print(f"trained on {world} rank(s) with backend {dist.get_backend()} in {elapsed:.2f} s")
    if args.check and rank == 0:
        single = make_model(args.seed)
        reference = train(single, x, y, args)
        same = all(torch.allclose(a, b, rtol=1e-4, atol=1e-5)
                   for a, b in zip(model.module.parameters(), single.parameters(), strict=True))
        print(f"single process: final loss {reference[-1]:.6f}; weights "
              f"{'match' if same else 'DO NOT match'} single-process training")
        if not same:
            raise SystemExit(1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
