"""What a user sees of the package: public names only (`tcoll --version`: tests/launch/test_launcher.py)."""

from __future__ import annotations

import importlib

import tcoll


def test_dir_shows_public_names_only() -> None:
    names = dir(tcoll)
    assert names == sorted(tcoll.__all__)
    for internal in ("algos", "comm", "p2p", "shm", "startup", "store", "transport", "api", "errors", "ops"):
        assert internal not in names
    assert all(hasattr(tcoll, name) for name in names)
    assert importlib.import_module("tcoll.algos").__name__ == "tcoll.algos"  # hidden from dir(), importable

