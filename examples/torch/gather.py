# Gather with torch.distributed on the tcoll backend.
# From the torch.distributed walk-through "Collective Communication in Distributed
# Systems with PyTorch" (Roboflow blog, 2023), unchanged except for the backend
# name ("gloo" became "tcoll") and the start (launching.py, no fixed port). Run it
# with `python examples/torch/gather.py` or `tcoll run -n 4 examples/torch/gather.py`.

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


def do_gather(rank: int, size: int):
    # create a group with all processors
    group = dist.new_group(list(range(size)))
    tensor = torch.tensor([rank], dtype=torch.float32)
    # sending all tensors from rank 0 to the others
    if rank == 0:
        # create an empty list we will use to hold the gathered values
        tensor_list = [torch.empty(1) for i in range(size)]
        dist.gather(tensor, gather_list=tensor_list, dst=0, group=group)
    else:
        dist.gather(tensor, gather_list=[], dst=0, group=group)
    # only rank 0 will have the tensors from the other processed
    # [tensor([0.]), tensor([1.]), tensor([2.]), tensor([3.])]
    if rank == 0:
        print(f"[{rank}] data = {tensor_list}")


if __name__ == "__main__":
    start(init_process, 4, do_gather)
