"""On a GPU: "cpu:tcoll,cuda:nccl" is one process group whose CUDA tensors run on NCCL and CPU tensors on tcoll.

World size 1 (NCCL refuses two ranks on one GPU, and the GPU machine has one).
Skips where torch sees no GPU or has no NCCL; scripts/gpu_check.sh runs it.
The routing itself is checked without a GPU in test_devices.py.
"""

from __future__ import annotations

import datetime
import os

import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402

from helpers.procs import free_port  # noqa: E402
from helpers.torch_workers import spawn  # noqa: E402

pytestmark = pytest.mark.skipif(not (torch.cuda.is_available() and dist.is_nccl_available()),
                                reason="needs a CUDA device and a torch with NCCL")


def _one_group_two_backends(rank: int, size: int, port: int) -> None:
    import tcoll.torch  # noqa: F401 - registers "tcoll" where no entry point does (a source checkout)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dist.init_process_group("cpu:tcoll,cuda:nccl", rank=rank, world_size=size,
                            timeout=datetime.timedelta(seconds=60))
    pg = dist.group.WORLD
    assert type(pg).__name__ == "ProcessGroupTcoll", type(pg)
    nccl = pg._get_backend(torch.device("cuda"))
    assert type(nccl).__name__ == "ProcessGroupNCCL", type(nccl)

    before = pg._get_sequence_number_for_group()  # tcoll's count of the calls it ran
    c = torch.arange(6, dtype=torch.float32, device="cuda") + rank
    dist.all_reduce(c)
    torch.testing.assert_close(c.cpu(), (torch.arange(6, dtype=torch.float32) * size
                                         + size * (size - 1) / 2))
    work = dist.all_reduce(c, async_op=True)
    work.wait()
    assert pg._get_sequence_number_for_group() == before, "a CUDA all_reduce reached tcoll"

    t = torch.arange(6, dtype=torch.float32) + rank
    dist.all_reduce(t)
    torch.testing.assert_close(t, torch.arange(6, dtype=torch.float32) * size + size * (size - 1) / 2)
    assert pg._get_sequence_number_for_group() == before + 1, "a CPU all_reduce did not run on tcoll"

    objects = [None] * size
    dist.all_gather_object(objects, {"rank": rank})  # torch moves objects as CPU or CUDA tensors: either way
    assert objects == [{"rank": q} for q in range(size)]

    sub = dist.new_group(list(range(size)), backend="cpu:tcoll,cuda:nccl")
    d = torch.ones(3, device="cuda")
    dist.all_reduce(d, group=sub)
    torch.testing.assert_close(d.cpu(), torch.full((3,), float(size)))
    dist.destroy_process_group()


@pytest.mark.timeout(180)
def test_cpu_tcoll_cuda_nccl_world_size_1() -> None:
    spawn(_one_group_two_backends, 1, free_port())
