"""`tcoll bench --device cuda`: whether this machine can, what it has, and the CUDA buffers of a rank.

Every rank's buffers are CUDA tensors, made once per measurement from the
sweep's host (NumPy) buffers, which stay the place where data is filled and
checked: `CudaBuffers` copies host to device after a fill and device to host
before a check. A rank uses GPU (local rank % GPU count), so ranks may share
one GPU. Nothing here imports torch until it is asked about CUDA.
"""

from __future__ import annotations

import importlib.util
from typing import Any

from .collectives import Buffers

__all__ = ["CudaBuffers", "TensorBuffers", "cuda_problem", "describe_cuda", "gpu_count", "nccl_version"]


def cuda_problem() -> str | None:
    """Why --device cuda cannot run here (one line), or None if torch sees a CUDA device."""
    if importlib.util.find_spec("torch") is None:
        return "--device cuda needs torch with CUDA, and torch is not installed"
    import torch

    if not torch.cuda.is_available():
        build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "a build without CUDA"
        return f"--device cuda needs a CUDA GPU, and torch {torch.__version__} ({build}) sees none"
    return None


def gpu_count() -> int:
    """The CUDA devices torch sees (0 without torch)."""
    if importlib.util.find_spec("torch") is None:
        return 0
    import torch

    return int(torch.cuda.device_count()) if torch.cuda.is_available() else 0


def nccl_version(torch: Any) -> str:
    """The NCCL version torch was built with ("2.27.3"), or "none"."""
    try:
        version = torch.cuda.nccl.version()
    except (AttributeError, RuntimeError):  # a torch built without NCCL
        return "none"
    return ".".join(str(part) for part in version) if isinstance(version, tuple) else str(version)


def describe_cuda() -> str:
    """The GPUs and the versions behind them, for the table's header: "1 GPU (NVIDIA H100 ...); torch ..."."""
    import torch

    names = [torch.cuda.get_device_name(index) for index in range(torch.cuda.device_count())]
    counted = {name: names.count(name) for name in names}
    gpus = ", ".join(f"{count}x {name}" if count > 1 else name for name, count in counted.items())
    return (f"{len(names)} GPU{'s' if len(names) != 1 else ''} ({gpus}); torch {torch.__version__}, "
            f"CUDA {torch.version.cuda}, NCCL {nccl_version(torch)}")


class TensorBuffers:
    """The placement (see sweep.HostBuffers) of a rank's buffers as torch tensors on `device`, copied from the host ones.

    On "cpu" it is the same copying without a GPU (the tests' way to check it); CudaBuffers is the GPU's.
    """

    def __init__(self, torch: Any, device: Any) -> None:
        self.torch = torch
        self.device = device

    def place(self, host: Buffers) -> Buffers:
        from .gloo_worker import to_torch

        return Buffers(*(None if arr is None else to_torch(arr).to(self.device, copy=True)
                         for arr in (host.inp, host.out)))

    def push(self, host: Buffers, placed: Buffers) -> None:
        from .gloo_worker import to_torch

        for arr, tensor in ((host.inp, placed.inp), (host.out, placed.out)):
            if arr is not None:
                tensor.copy_(to_torch(arr))

    def pull(self, placed: Buffers, host: Buffers) -> None:
        from .gloo_worker import to_torch

        for tensor, arr in ((placed.inp, host.inp), (placed.out, host.out)):
            if arr is not None:
                to_torch(arr).copy_(tensor)  # into the NumPy array's own memory (to_torch shares it)

    def synchronize(self) -> None:
        """Nothing to wait for on the CPU."""


class CudaBuffers(TensorBuffers):
    """A rank's buffers on GPU (local rank % GPU count), which it makes the current device."""

    def __init__(self, local_rank: int) -> None:
        import torch

        index = local_rank % torch.cuda.device_count()
        torch.cuda.set_device(index)  # ranks may share a GPU: tcoll stages their calls through host memory
        super().__init__(torch, torch.device("cuda", index))

    def synchronize(self) -> None:
        """Wait for every stream of this GPU: a CUDA call returns before the device has done its work."""
        self.torch.cuda.synchronize()
