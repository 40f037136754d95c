"""DDP training steps per second on the tcoll backend against gloo, in the same run.

    python benchmarks/torch_ddp.py                        # MLP and transformer block, 2 and 4 ranks
    python benchmarks/torch_ddp.py --ranks 4 --models mlp --runs 3 --steps 20

Each rank count starts its processes once (torch.multiprocessing, spawn).
The default group is tcoll's; a gloo group of the same ranks is made next to
it. "tcoll+hook" is the tcoll group with `tcoll.torch.ddp_hook` registered
(each bucket averaged through a persistent plan over shared memory). For each
model and backend, in turns (tcoll, tcoll+hook, gloo, no DDP, tcoll, ...), a
run wraps a freshly seeded model in DistributedDataParallel on that group,
takes 3 warm-up steps, then times `--steps` steps (forward, backward with
DDP's bucketed all-reduces, SGD step); the slowest rank's mean is the run's
time. The table shows the median over the runs as steps per second.
"no DDP" runs the same steps on the same ranks at the same time without
DDP (no communication): the most any backend could reach. The last
columns are what each backend adds to a step over it: DDP's all-reduces and
their waiting.

Models (float32, batch 32 per rank):
- mlp: 64-1024-1024-64 with ReLU, about 1.2 M parameters (5 MB of gradients, several buckets);
- transformer: one nn.TransformerEncoderLayer (d_model 256, 4 heads, feed-forward 1024),
  sequences of 32 tokens, about 0.8 M parameters.

Set OMP_NUM_THREADS=1 (done here if unset): torch's intra-op threads of
several ranks on a few cores slow every rank down, whatever the backend.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import statistics
import sys
import tempfile
import time

BACKENDS = ("tcoll", "tcoll+hook", "gloo", "local")  # local: the same step without DDP, no communication
DDP_BACKENDS = BACKENDS[:-1]
MODELS = ("mlp", "transformer")


def _model(name: str):
    import torch

    torch.manual_seed(0)
    if name == "mlp":
        net = torch.nn.Sequential(torch.nn.Linear(64, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 1024),
                                  torch.nn.ReLU(), torch.nn.Linear(1024, 64))
        return net, torch.randn(32, 64), torch.randn(32, 64)
    net = torch.nn.TransformerEncoderLayer(d_model=256, nhead=4, dim_feedforward=1024, dropout=0.0,
                                           batch_first=True)
    return net, torch.randn(32, 32, 256), torch.randn(32, 32, 256)


def _worker(rank: int, size: int, port: int, models: list[str], runs: int, steps: int, out_dir: str) -> None:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import tcoll.torch  # registers the backend; its ddp_hook is "tcoll+hook"

    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("tcoll", rank=rank, world_size=size, timeout=datetime.timedelta(seconds=600))
    groups = {"tcoll": dist.group.WORLD, "tcoll+hook": dist.group.WORLD,
              "gloo": dist.new_group(list(range(size)), backend="gloo"), "local": dist.group.WORLD}
    times = {m: {b: [] for b in BACKENDS} for m in models}
    for _ in range(runs):
        for name in models:
            for backend in BACKENDS:
                net, x, y = _model(name)
                model = net if backend == "local" else DDP(net, process_group=groups[backend])
                if backend == "tcoll+hook":
                    model.register_comm_hook(groups[backend], tcoll.torch.ddp_hook)
                opt = torch.optim.SGD(model.parameters(), lr=0.001)

                def step() -> None:
                    opt.zero_grad()
                    torch.nn.functional.mse_loss(model(x), y).backward()
                    opt.step()

                for _ in range(3):
                    step()
                dist.barrier(group=groups[backend])
                start = time.perf_counter()
                for _ in range(steps):
                    step()
                elapsed = torch.tensor([(time.perf_counter() - start) / steps], dtype=torch.float64)
                dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
                times[name][backend].append(elapsed.item())
    if rank == 0:
        with open(os.path.join(out_dir, "times.json"), "w") as handle:
            json.dump(times, handle)
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def measure(ranks: int, models: list[str], runs: int, steps: int) -> dict[str, dict[str, float]]:
    """Median seconds per step, {model: {backend: seconds}}, for `ranks` processes."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as out_dir:
        mp.spawn(_worker, args=(ranks, _free_port(), models, runs, steps, out_dir), nprocs=ranks, join=True)
        with open(os.path.join(out_dir, "times.json")) as handle:
            raw = json.load(handle)
    return {m: {b: statistics.median(v) for b, v in per.items()} for m, per in raw.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", default="2,4", help="comma-separated rank counts (default 2,4)")
    parser.add_argument("--models", default=",".join(MODELS), help="mlp, transformer (default both)")
    parser.add_argument("--runs", type=int, default=3, help="timed runs per model and backend; the median is shown")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per run")
    args = parser.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    models = [m for m in args.models.split(",") if m]
    header = ["model", "ranks", *(f"{b} (steps/s)" for b in DDP_BACKENDS), "tcoll vs gloo", "tcoll+hook vs gloo",
              "no DDP (steps/s)", *(f"{b} ms/step over no DDP" for b in DDP_BACKENDS)]
    print(" | ".join(header))
    print("|".join(["---"] + ["---:"] * (len(header) - 1)))
    for ranks in (int(r) for r in args.ranks.split(",")):
        result = measure(ranks, models, args.runs, args.steps)
        for name in models:
            times, none = result[name], result[name]["local"]
            cells = [name, str(ranks), *(f"{1 / times[b]:.1f}" for b in DDP_BACKENDS),
                     *(f"{times['gloo'] / times[b]:.2f}x" for b in ("tcoll", "tcoll+hook")), f"{1 / none:.1f}",
                     *(f"{(times[b] - none) * 1e3:.2f}" for b in DDP_BACKENDS)]
            print(" | ".join(cells), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
