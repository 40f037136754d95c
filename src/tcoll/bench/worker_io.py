"""Plan in, results out: the file handling shared by the gloo and MPI worker modules."""

from __future__ import annotations

import json
import os
import sys
from typing import Any

__all__ = ["read_plan", "write_result"]


def read_plan() -> tuple[dict[str, Any], str]:
    """The plan (argv[1], JSON) and where rank 0 writes its result (argv[2])."""
    if len(sys.argv) != 3:
        raise SystemExit(f"usage: python -m {sys.argv[0]} PLAN.json OUT.json (started by tcoll bench)")
    with open(sys.argv[1]) as handle:
        return json.load(handle), sys.argv[2]


def write_result(path: str, result: dict[str, Any]) -> None:
    """Write rank 0's result atomically (the parent reads all of it or nothing)."""
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as handle:
        json.dump(result, handle)
    os.rename(tmp, path)
