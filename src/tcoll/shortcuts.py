"""Module-level functions (`tcoll.all_reduce(x)`, ...) acting on the default communicator.

Each one calls the Communicator method of the same name on
`tcoll.default_communicator()`, the communicator of the first `tcoll.init()`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from .algos.registry import names
from .comm import Communicator
from .world import default_communicator

__all__ = ["algorithms", "SHORTCUTS"]

SHORTCUTS = (
    "send", "recv", "isend", "irecv",
    "all_reduce", "reduce", "broadcast", "all_gather", "gather", "scatter", "reduce_scatter", "all_to_all",
    "barrier", "all_gatherv", "gatherv", "scatterv", "all_to_allv", "reduce_scatterv",
    "broadcast_object", "all_gather_object", "gather_object", "scatter_object", "send_object", "recv_object",
    "split", "group", "dup",
)


def algorithms(collective: str) -> list[str]:
    """The names that `algorithm=` accepts for `collective` (besides "auto").

    Raises:
        ValueError: an unknown collective.
    """
    return names(collective)


def _shortcut(name: str) -> Callable[..., Any]:
    method = getattr(Communicator, name)

    @functools.wraps(method)
    def call(*args: Any, **kwargs: Any) -> Any:
        return getattr(default_communicator(), name)(*args, **kwargs)

    call.__doc__ = f"{name} on the default communicator (see Communicator.{name}).\n\n{method.__doc__ or ''}"
    return call


def make_shortcuts() -> dict[str, Callable[..., Any]]:
    """A module-level function for every method in SHORTCUTS that Communicator has."""
    return {name: _shortcut(name) for name in SHORTCUTS if hasattr(Communicator, name)}
