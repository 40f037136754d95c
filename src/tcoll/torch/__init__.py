"""tcoll as a torch.distributed backend: `dist.init_process_group("tcoll")`.

    import tcoll.torch                      # registers "tcoll" (torch also loads it by itself)
    import torch.distributed as dist
    dist.init_process_group("tcoll")        # under torchrun, `tcoll run`, or mp.spawn with MASTER_ADDR/PORT

Importing this package registers the backend with
`torch.distributed.Backend.register_backend`. torch also registers it without
an explicit import, through the `torch.backends` entry point that calls
`_autoload` while torch itself is imported (TORCH_DEVICE_BACKEND_AUTOLOAD=0
turns that off). The process group lives in `tcoll.torch.process_group`,
imported only when torch creates a "tcoll" group, so registering costs
nothing but torch.distributed's import.

`tcoll.torch.empty(shape, dtype)` makes a tensor in shared memory that the
collectives of a one-host tcoll group read in place (no copy into their
arena): the counterpart of registering a buffer with NCCL.

`model.register_comm_hook(group, tcoll.torch.ddp_hook)` makes DDP average
each gradient bucket through a persistent tcoll plan over shared memory
(`tcoll.torch.ddp`).

`tcoll.torch.revoke(group)` and `tcoll.torch.shrink_group(group)` let the
survivors of a dead rank go on in a new group (`tcoll.torch.survival`).

Owns: the ProcessGroup, its Work, the DDP comm hook, tensor conversions, which communicator serves a group,
any-source receives.
May import: everything below the top (comm, startup, store, ...); the only package that imports torch.
"""

from __future__ import annotations

import sys
import warnings
from typing import Any

__all__ = ["register", "empty", "split_group", "ddp_hook", "ProcessGroupTcoll", "BACKEND_NAME", "shrink_group",
           "revoke", "failed", "agree"]

BACKEND_NAME = "tcoll"


def register() -> None:
    """Register the "tcoll" backend with torch.distributed (again is harmless).

    Raises:
        ImportError: torch is not installed, or was built without torch.distributed.
    """
    import torch.distributed as dist

    if not dist.is_available():
        raise ImportError("this torch build has no torch.distributed: the tcoll backend needs it")
    if getattr(dist.Backend, BACKEND_NAME.upper(), None) == BACKEND_NAME and _registered(dist):
        return
    # devices as a list: torch 2.13 iterates a bare string character by character.
    dist.Backend.register_backend(BACKEND_NAME, _create, extended_api=True, devices=["cpu"])


def _registered(dist: Any) -> bool:
    plugins = getattr(dist.Backend, "_plugins", {})
    return BACKEND_NAME.upper() in plugins


def _create(options: Any, backend_options: Any = None) -> Any:
    """torch's creator for "tcoll": defers to `tcoll.torch.groups.create_backend`."""
    from .groups import create_backend

    return create_backend(options, backend_options)


def __getattr__(name: str) -> Any:
    """`empty`, `ProcessGroupTcoll`, `split_group`, `ddp_hook` and the survival calls are imported on first use."""
    if name == "ProcessGroupTcoll":
        from .process_group import ProcessGroupTcoll

        return ProcessGroupTcoll
    if name == "ddp_hook":
        from .ddp import ddp_hook

        return ddp_hook
    if name in ("empty", "split_group"):
        from . import groups

        return getattr(groups, name)
    if name in ("shrink_group", "revoke", "failed", "agree"):
        from . import survival

        return getattr(survival, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _torch_initialising() -> bool:
    """Whether `import torch` is still running (the entry point is called from inside it)."""
    module = sys.modules.get("torch")
    spec = getattr(module, "__spec__", None)
    return module is not None and bool(getattr(spec, "_initializing", False))


def _autoload() -> None:
    """The `torch.backends` entry point: registering already happened at import; never break torch's import."""
    if _error is not None:
        warnings.warn(f"tcoll could not register its torch.distributed backend: {_error}", RuntimeWarning,
                      stacklevel=2)


_error: BaseException | None = None
try:
    register()
except Exception as exc:  # noqa: BLE001 - from torch's own import, a failure must not break `import torch`
    if not _torch_initialising():
        raise
    _error = exc
