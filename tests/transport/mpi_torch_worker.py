"""torch.distributed's all_reduce through the tcoll backend, every message over MPI (run by test_mpi under mpiexec).

Usage: mpi_torch_worker.py PORT OUT_DIR; writes OUT_DIR/rank<R> with "ok" when the result matches NumPy.
"""

from __future__ import annotations

import os
import sys

import numpy as np
import torch
import torch.distributed as dist

import tcoll.torch  # noqa: F401 - registers the backend

rank, size = int(os.environ["PMI_RANK"]), int(os.environ["PMI_SIZE"])
dist.init_process_group("tcoll", init_method=f"tcp://127.0.0.1:{sys.argv[1]}", rank=rank, world_size=size)
t = torch.arange(1000, dtype=torch.float32) * (rank + 1)
dist.all_reduce(t)
want = np.arange(1000, dtype=np.float32) * (size * (size + 1) / 2)
with open(os.path.join(sys.argv[2], f"rank{rank}"), "w") as handle:
    handle.write("ok" if np.allclose(t.numpy(), want) else f"wrong: {t[:4]}")
dist.destroy_process_group()
