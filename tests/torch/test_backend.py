"""The torch.distributed backend "tcoll": registration, and every collective and point-to-point call.

Each spawn starts its ranks once (importing torch costs a second or two per
process) and runs the whole suite of tests/helpers/torch_workers.py in them: every
collective, blocking and with async_op=True, in both call modes (collectives
completed inside the call; started asynchronously with TCOLL_TORCH_ASYNC=1),
for every ReduceOp and dtype, against references computed in each rank from
every rank's known input.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

from helpers import torch_workers  # noqa: E402
from helpers.procs import free_port

ROOT = Path(__file__).resolve().parents[2]


def _python(code: str, **env: str) -> subprocess.Popen[str]:
    full = dict(os.environ, PYTHONPATH=str(ROOT / "src"), **env)
    return subprocess.Popen([sys.executable, "-c", code], env=full, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


_CHECK = """
import sys, torch, torch.distributed as dist
registered = getattr(dist.Backend, "TCOLL", None) == "tcoll"
if {explicit}:
    assert not registered and "tcoll.torch" not in sys.modules, "autoload was off, yet tcoll registered"
    import tcoll.torch
    registered = getattr(dist.Backend, "TCOLL", None) == "tcoll"
assert registered, "backend tcoll is not registered"
assert dist.Backend.backend_capability["tcoll"] == ["cpu"], dist.Backend.backend_capability["tcoll"]
import tcoll.torch
tcoll.torch.register()  # again: harmless
dist.init_process_group("tcoll", store=dist.HashStore(), rank=0, world_size=1)
t = torch.arange(4.0)
dist.all_reduce(t)
assert dist.get_backend() == "tcoll" and torch.equal(t, torch.arange(4.0))
assert type(dist.group.WORLD).__name__ == "ProcessGroupTcoll"
dist.destroy_process_group()
print("ok")
"""


@pytest.mark.timeout(120)
def test_registration() -> None:
    """`import torch` alone registers "tcoll" (the torch.backends entry point), for devices ["cpu"];
    with TORCH_DEVICE_BACKEND_AUTOLOAD=0 it does not, and `import tcoll.torch` does. (Both interpreters at once.)"""
    running = [_python(_CHECK.format(explicit=False)),
               _python(_CHECK.format(explicit=True), TORCH_DEVICE_BACKEND_AUTOLOAD="0")]
    for process in running:
        out, err = process.communicate(timeout=110)
        assert process.returncode == 0 and out.strip() == "ok", err


@pytest.mark.timeout(180)
def test_every_collective_and_p2p_call_3_ranks(monkeypatch: pytest.MonkeyPatch) -> None:
    """The full suite on 3 ranks (not a power of two), with 4 KiB reduce-chain messages (multi-chunk paths)."""
    monkeypatch.setenv("TCOLL_COLL_CHUNK", "4K")
    torch_workers.spawn(torch_workers.collectives, 3, free_port())


@pytest.mark.timeout(180)
@pytest.mark.parametrize("size,transport", [(2, "tcp"), (4, "shm")])
def test_collectives_2_and_4_ranks(size: int, transport: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The blocking suite on 2 ranks over TCP and on 4 ranks over shared memory."""
    monkeypatch.setenv("TCOLL_TRANSPORT", transport)
    torch_workers.spawn(torch_workers.collectives_quick, size, free_port())


@pytest.mark.timeout(180)
@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_ranks_that_disagree_all_get_an_error_and_nothing_shifts(transport: str,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """op, dtype, root (reduce among them), dtypes of moved bytes, and local errors on one rank (tcoll's and the
    backend's own checks), through dist.*: every rank raises, the next call is right on every rank."""
    monkeypatch.setenv("TCOLL_TRANSPORT", transport)
    torch_workers.spawn(torch_workers.disagreements, 3, free_port())
