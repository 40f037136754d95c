# All reduce with torch.distributed on the tcoll backend.
# From the torch.distributed walk-through "Collective Communication in Distributed
# Systems with PyTorch" (Roboflow blog, 2023), unchanged except for the backend
# name ("gloo" became "tcoll") and the start (launching.py, no fixed port). Run it
# with `python examples/torch/all_reduce.py` or `tcoll run -n 4 examples/torch/all_reduce.py`.

import os
from typing import Callable

import torch
import torch.distributed as dist
from launching import start  # as one rank of tcoll run / torchrun, or 4 ranks here


def init_process(rank: int, size: int, fn: Callable[[int, int], None], backend="tcoll"):
    """Initialize the distributed environment."""
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29500")
    dist.init_process_group(backend, rank=rank, world_size=size)
    fn(rank, size)


def do_all_reduce(rank: int, size: int):
    # create a group with all processors
    group = dist.new_group(list(range(size)))
    tensor = torch.ones(1)
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)
    # can be dist.ReduceOp.PRODUCT, dist.ReduceOp.MAX, dist.ReduceOp.MIN
    # will output 4 for all ranks
    print(f"[{rank}] data = {tensor[0]}")


if __name__ == "__main__":
    start(init_process, 4, do_all_reduce)
