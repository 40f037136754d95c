"""tcoll's ranks on CUDA buffers (`tcoll bench --device cuda`).

This module imports torch when it is imported, on purpose: a rank process of
tcoll.spawn loads its function (`tcoll_cuda_worker`, from here) before it makes
its communicator, so torch is loaded by then, and with TCOLL_GPU unset or
"auto" tcoll wraps the communicator's calls for CUDA buffers (docs/gpu.md:
it does so where torch, imported before the first communicator, sees a GPU).
"""

from __future__ import annotations

import os
from typing import Any

import torch  # noqa: F401 - loaded before the rank's communicator is made (see above)

from .device import CudaBuffers
from .tcoll_backend import tcoll_worker

__all__ = ["tcoll_cuda_worker"]


def tcoll_cuda_worker(comm: Any, plan: dict[str, Any]) -> dict[str, Any] | None:
    """A tcoll rank of the sweep with its buffers on GPU (local rank % GPU count); rank 0 returns the rows."""
    local_rank = int(os.environ.get("TCOLL_LOCAL_RANK", comm.rank))
    return tcoll_worker(comm, plan, CudaBuffers(local_rank))
