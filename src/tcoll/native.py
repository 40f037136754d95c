"""The C extensions' side of the constants they share with Python, compared when they load.

A constant that C and Python must agree on (a wire format's magic, a layout's sizes, the codes of
dtypes and ops) is defined in Python; the C module exports its own copy, and the module that loads
the extension compares the two at import, refusing a stale or edited build with a message that names
every difference, instead of corrupting data later.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["check_exports"]


def check_exports(module: Any, ours: Mapping[str, Any], owner: str, what: str) -> None:
    """Refuse a built extension whose exported constants differ from Python's.

    Args:
        module: the extension, or None (not built: nothing to compare).
        ours: {constant name: Python's value}.
        owner: the Python module that defines them (named in the message).
        what: what the extension must match ("the wire format it writes", ...).

    Raises:
        ImportError: naming every constant that differs, and how to rebuild.
    """
    if module is None:
        return
    differ = [f"{name} is {getattr(module, name, None)!r} in C but {value!r} in {owner}"
              for name, value in ours.items() if getattr(module, name, None) != value]
    if differ:
        raise ImportError(f"{module.__name__} ({module.__file__}) does not match {what}: {'; '.join(differ)}. "
                          "Rebuild it (pip install ., or build_ext --inplace in a checkout)")
