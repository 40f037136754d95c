# Broadcast with torch.distributed on the tcoll backend.
# From the torch.distributed walk-through "Collective Communication in Distributed
# Systems with PyTorch" (Roboflow blog, 2023), unchanged except for the backend
# name ("gloo" became "tcoll") and the start (launching.py, no fixed port). Run it
# with `python examples/torch/broadcast.py` or `tcoll run -n 4 examples/torch/broadcast.py`.

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


def do_broadcast(rank: int, size: int):
    # create a group with all processors
    group = dist.new_group(list(range(size)))
    if rank == 0:
        tensor = torch.tensor([rank], dtype=torch.float32)
    else:
        tensor = torch.empty(1)
        # sending all tensors to the others
    dist.broadcast(tensor, src=0, group=group)
    # all ranks will have tensor([0.]) from rank 0
    print(f"[{rank}] data = {tensor}")


if __name__ == "__main__":
    start(init_process, 4, do_broadcast)
