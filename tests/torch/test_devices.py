"""One process group, two backends: "cpu:tcoll,<device>:<backend>" routes each tensor by its device.

This machine has no GPU, so the second device here is "meta" served by
torch's fake backend (which accepts any tensor and moves nothing) and "cuda"
served by gloo (built, registered, not called): what they prove is the
routing, which is the same code for "cuda:nccl". The CUDA half of
"cpu:tcoll,cuda:nccl" is checked on a GPU by scripts/gpu_check.sh
(tests/torch/test_cuda.py).
"""

from __future__ import annotations

import datetime
import os

import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402

from helpers.procs import free_port  # noqa: E402
from helpers.torch_workers import spawn  # noqa: E402


def _routed(rank: int, size: int, port: int) -> None:
    import torch.testing._internal.distributed.fake_pg  # noqa: F401 - registers "fake"
    import tcoll.torch  # noqa: F401 - registers "tcoll" where no entry point does (a source checkout)

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("cpu:tcoll,meta:fake,cuda:gloo", rank=rank, world_size=size,
                            timeout=datetime.timedelta(seconds=60))
    pg = dist.group.WORLD
    assert type(pg).__name__ == "ProcessGroupTcoll", type(pg)
    assert type(pg._get_backend(torch.device("cuda"))).__name__ == "ProcessGroupGloo"
    assert type(pg._get_backend(torch.device("meta"))).__name__ == "FakeProcessGroup"
    with pytest.raises(RuntimeError):
        pg._get_backend(torch.device("cpu"))  # the group itself is tcoll: no C++ backend for the CPU

    # A CPU tensor runs on tcoll (the group's tcoll call count moves, and the sum is right).
    before = pg._get_sequence_number_for_group()
    t = torch.full((5,), float(rank + 1))
    dist.all_reduce(t)
    assert torch.equal(t, torch.full((5,), float(size * (size + 1) // 2)))
    assert pg._get_sequence_number_for_group() == before + 1

    # Meta tensors go to the fake backend: tcoll cannot read them (it raises), the fake backend takes them,
    # and tcoll's count does not move.
    m = torch.ones(4, device="meta")
    dist.all_reduce(m)
    dist.broadcast(m, 0)
    dist.all_gather([torch.empty(4, device="meta") for _ in range(size)], m)
    dist.all_gather_into_tensor(torch.empty(4 * size, device="meta"), m)
    dist.reduce_scatter_tensor(torch.empty(4, device="meta"), torch.empty(4 * size, device="meta"))
    dist.all_to_all_single(torch.empty(2 * size, device="meta"), torch.empty(2 * size, device="meta"))
    dist.all_reduce(torch.ones(3, device="meta"), async_op=True).wait()
    assert pg._get_sequence_number_for_group() == before + 1

    # A subgroup made with the same string routes as well; a tcoll-only one hands a meta tensor to tcoll.
    sub = dist.new_group(list(range(size)), backend="cpu:tcoll,meta:fake")
    dist.all_reduce(torch.ones(3, device="meta"), group=sub)
    plain = dist.new_group(list(range(size)), backend="tcoll")
    with pytest.raises((TypeError, RuntimeError)):
        dist.all_reduce(torch.ones(3, device="meta"), group=plain)
    u = torch.full((3,), float(rank))
    dist.all_reduce(u, group=sub)
    assert torch.equal(u, torch.full((3,), float(size * (size - 1) // 2)))
    dist.destroy_process_group()


@pytest.mark.timeout(180)
def test_cpu_tcoll_beside_another_device_backend_2_ranks() -> None:
    """CPU tensors on tcoll, meta tensors on the fake backend, in one group and in a subgroup; gloo built for cuda."""
    spawn(_routed, 2, free_port())


def _nccl_missing(rank: int, size: int, port: int) -> None:
    import tcoll.torch  # noqa: F401
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    with pytest.raises(RuntimeError, match="no NCCL"):
        dist.init_process_group("cpu:tcoll,cuda:nccl", rank=rank, world_size=size,
                                timeout=datetime.timedelta(seconds=60))


@pytest.mark.timeout(120)
@pytest.mark.skipif(dist.is_nccl_available(), reason="this torch has NCCL: scripts/gpu_check.sh covers it")
def test_cuda_nccl_on_a_torch_without_nccl_says_so() -> None:
    """On a CPU-only torch, "cpu:tcoll,cuda:nccl" fails at init with a named reason, not at the first CUDA call."""
    spawn(_nccl_missing, 1, free_port())
