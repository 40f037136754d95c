"""DDP and FSDP2 on the tcoll backend train exactly as one process does; a killed peer is a clean error.

DDP (default buckets, tiny buckets, gradient_as_bucket_view, static_graph,
find_unused_parameters, no_sync, Join with uneven inputs, the allreduce and
fp16-compression comm hooks) and FSDP2's fully_shard are checked in the ranks
against training in one process (tests/helpers/torch_workers.py: `reference`).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

pytest.importorskip("torch")

from helpers import torch_workers  # noqa: E402
from helpers.procs import free_port


@pytest.mark.timeout(180)
def test_ddp_and_fsdp_match_single_process_training() -> None:
    torch_workers.spawn(torch_workers.ddp_and_fsdp, 2, free_port())


@pytest.mark.timeout(180)
def test_killed_peer_during_ddp_is_a_python_error_naming_it(tmp_path: Path) -> None:
    """Rank 0 of 3 dies in DDP training; the survivors' backward raises PeerLostError naming it, within seconds.

    No crash, no hang; rank 0 also hosted torch's TCPStore.
    """
    import torch.multiprocessing as mp

    size, victim = 3, 0
    context = mp.start_processes(torch_workers.ddp_victim, args=(size, free_port(), str(tmp_path), victim),
                                 nprocs=size, join=False, start_method=torch_workers.START_METHOD)
    deadline = time.monotonic() + 150
    for process in context.processes:
        process.join(max(0.1, deadline - time.monotonic()))
    codes = [p.exitcode for p in context.processes]
    for process in context.processes:
        if process.is_alive():
            process.kill()
    assert codes == [-9 if r == victim else 0 for r in range(size)], codes  # SIGKILL for the victim only
    for rank in range(size):
        if rank == victim:
            continue
        report = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert report["steps"] == 2, report  # both earlier steps trained
        assert report.get("error") == "PeerLostError", report
        assert f"rank {victim}" in report["message"], report
        assert report["seconds"] < 30, report
    assert not os.path.exists(tmp_path / f"rank{victim}.json")
