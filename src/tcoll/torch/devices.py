"""The other devices of a tcoll group: `init_process_group("cpu:tcoll,cuda:nccl")` routes by tensor device.

What torch expects of a third-party backend. torch builds the process group
itself and routes by device only for backends that are C++ `c10d::Backend`
objects (gloo, NCCL, and C++ extensions such as torch_ucc and oneCCL, bound
with pybind11 as Backend subclasses): `_new_process_group_helper` makes a
plain `ProcessGroup` and calls `pg._register_backend(device, type, backend)`
once per device of the backend string. torch (2.1 to 2.13) gives Python no way
to write such an object: `torch._C._distributed_c10d.Backend` has no Python
constructor and no trampoline (only `ProcessGroup` has one, PyProcessGroup).
A creator that returns a `ProcessGroup` subclass, as tcoll's does, is used as
the whole group, and the loop over the other devices stops there
(`if issubclass(type(backend_class), ProcessGroup): pg = backend_class; break`).

So tcoll does the rest of that loop itself: while torch runs its creator, it
reads the group's device map from torch's helper (its `backend_config`),
builds each other device's backend as torch would (same store prefix
`<device>/`, same options, same sequence-number set-up) and registers it on
the tcoll process group with `_register_backend`. The group's methods then
send a call whose tensors are on such a device to that backend (`route`), and
keep CPU tensors for tcoll. `pg._get_backend(torch.device("cuda"))` is the
NCCL backend, as in a group torch built; there is no C++ backend for "cpu"
(`pg._get_backend(torch.device("cpu"))` raises), since the group itself is tcoll.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from . import BACKEND_NAME

__all__ = ["other_devices", "make_backend", "attach", "routed", "device_of", "install"]

_HELPER = "_new_process_group_helper"


def other_devices() -> tuple[dict[str, str], Any]:
    """The devices other than tcoll's in the group torch is making now, and the group's pg_options.

    Returns:
        ({device type: backend name} for every device not mapped to tcoll, the
        pg_options given to init_process_group / new_group); ({}, None) when
        not called from inside torch's group creation (or a torch whose helper
        keeps its map elsewhere: then the group is tcoll's alone, as before).
    """
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == _HELPER and frame.f_globals.get("__name__") == c10d.__name__:
            config = frame.f_locals.get("backend_config")
            mapping = config.get_device_backend_map() if config is not None else {}
            options = frame.f_locals.get("backend_options", frame.f_locals.get("pg_options"))
            return {d: str(b) for d, b in mapping.items() if str(b) != BACKEND_NAME}, options
        frame = frame.f_back
    return {}, None


def make_backend(name: str, device: str, options: Any, backend_options: Any) -> tuple[Any, Any]:
    """Build the backend `name` for `device` as torch's `_new_process_group_helper` builds it.

    Args:
        name: the backend's name ("nccl", "gloo", or a registered plugin's).
        device: the device type it serves ("cuda", ...).
        options: torch's _DistributedBackendOptions given to tcoll's creator (its store is tcoll's
            `cpu/` prefix store; the other backend gets `<device>/` under the same group prefix).
        backend_options: the pg_options of the call (NCCL's Options, if given, are NCCL's).

    Returns:
        (the c10d Backend, its ProcessGroup.BackendType).

    Raises:
        RuntimeError: this torch has no such backend (NCCL on a CPU build), or the plugin made a whole
            ProcessGroup (two Python process groups cannot share one group).
    """
    store = dist.PrefixStore(f"{device}/", options.store.underlying_store)
    rank, size, timeout = int(options.group_rank), int(options.group_size), options.timeout
    ranks, group_name = list(options.global_ranks_in_group), options.group_id
    kinds = dist.ProcessGroup.BackendType
    if name == dist.Backend.GLOO:
        if not dist.is_gloo_available():
            raise RuntimeError("this torch has no Gloo: cannot serve " + device)
        backend = c10d.ProcessGroupGloo(store, rank, size, timeout=timeout)
        _set_options(backend.options, ranks, group_name)
        backend._set_sequence_number_for_group()
        return backend, kinds.GLOO
    if name == dist.Backend.NCCL:
        if not dist.is_nccl_available():
            raise RuntimeError(f"this torch has no NCCL (torch {torch.__version__}): cannot serve {device}")
        nccl = c10d.ProcessGroupNCCL
        opts = backend_options if isinstance(backend_options, nccl.Options) else nccl.Options()
        if opts is not backend_options:
            opts.is_high_priority_stream = False
        opts._timeout = timeout
        _set_options(opts, ranks, group_name)
        backend = nccl(store, rank, size, opts)
        backend._set_sequence_number_for_group()
        return backend, kinds.NCCL
    plugin = dist.Backend._plugins.get(name.upper())
    if plugin is None:
        raise RuntimeError(f"backend {name!r} for {device} beside tcoll: tcoll builds gloo, nccl and "
                           "registered plugins only")
    if plugin.extended_api:
        made = plugin.creator_fn(_options_for(store, options), backend_options)
    else:
        made = plugin.creator_fn(store, rank, size, timeout)
    if isinstance(made, dist.ProcessGroup):
        raise RuntimeError(f"backend {name!r} makes a whole ProcessGroup, which cannot serve one device "
                           "of a tcoll group")
    return made, kinds.CUSTOM


def _set_options(opts: Any, ranks: list[int], group_name: str) -> None:
    """Set what torch sets on gloo's and NCCL's options (attributes some versions lack are skipped)."""
    for attr, value in (("global_ranks_in_group", ranks), ("group_name", group_name)):
        if hasattr(opts, attr):
            setattr(opts, attr, value)


def _options_for(store: Any, options: Any) -> Any:
    """A copy of torch's _DistributedBackendOptions with another store (for a plugin's creator)."""
    made = c10d._DistributedBackendOptions()
    made.store = store
    for attr in ("group_rank", "group_size", "timeout", "group_id", "global_ranks_in_group"):
        setattr(made, attr, getattr(options, attr))
    return made


def attach(pg: Any, devices: dict[str, str], options: Any, backend_options: Any) -> dict[str, Any]:
    """Build the backend of every device in `devices` and register it on `pg`; returns {device: backend}."""
    routes = {}
    for device, name in devices.items():
        backend, kind = make_backend(name, device, options, backend_options)
        pg._register_backend(torch.device(device), kind, backend)
        routes[device] = backend
    return routes


def device_of(args: tuple[Any, ...] | list[Any]) -> str:
    """The device type of the first tensor in `args` (nested lists searched in order), or "cpu" if none."""
    for arg in args:
        if isinstance(arg, torch.Tensor):
            return arg.device.type
        if isinstance(arg, (list, tuple)):
            for inner in _tensors(arg):
                return inner.device.type
    return "cpu"


def _tensors(items: list[Any] | tuple[Any, ...]) -> Any:
    for item in items:
        if isinstance(item, torch.Tensor):
            yield item
        elif isinstance(item, (list, tuple)):
            yield from _tensors(item)


_Method = Callable[..., Any]


def routed(backend_method: str) -> Callable[[_Method], _Method]:
    """Send a call whose tensors lie on a routed device to that device's backend, else run it on tcoll.

    Args:
        backend_method: the Backend method of the same call (torch's names differ for some, e.g.
            `_allgather_base` for all_gather_single).
    """

    def wrap(fn: _Method) -> _Method:
        @functools.wraps(fn)
        def method(pg: Any, *args: Any, **kwargs: Any) -> Any:
            routes = pg._routes
            if routes:
                backend = routes.get(device_of(args))
                if backend is not None:
                    return getattr(backend, backend_method)(*args, **kwargs)
            return fn(pg, *args, **kwargs)

        return method

    return wrap


# The process group's methods that take tensors (allreduce routes inline, on its fast path), each with the
# Backend method of the same call and the aliases torch also calls it by.
_ROUTED = {
    "allreduce_coalesced": ("allreduce_coalesced", ()),
    "reduce": ("reduce", ()),
    "reduce_scatter": ("reduce_scatter", ()),
    "reduce_scatter_single": ("_reduce_scatter_base", ("_reduce_scatter_base",)),
    "broadcast": ("broadcast", ()),
    "allgather": ("allgather", ()),
    "all_gather_single": ("_allgather_base", ("_allgather_base",)),
    "allgather_coalesced": ("allgather_coalesced", ()),
    "gather": ("gather", ()),
    "scatter": ("scatter", ()),
    "all_to_all_single": ("alltoall_base", ("alltoall_base",)),
    "alltoall": ("alltoall", ()),
    "send": ("send", ()),
    "recv": ("recv", ()),
    "recv_anysource": ("recv_anysource", ()),
}


def install(cls: type) -> None:
    """Wrap `cls`'s tensor methods (and their aliases) with `routed`, outermost (before tcoll numbers a call)."""
    for name, (backend_method, aliases) in _ROUTED.items():
        wrapped = routed(backend_method)(getattr(cls, name))
        for attr in (name, *aliases):
            setattr(cls, attr, wrapped)
