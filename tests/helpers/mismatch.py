"""Calls on which ranks disagree: what each rank raised, and the check that every rank raised it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import tcoll

__all__ = ["assert_every_rank_raised", "mismatch_said"]


def mismatch_said(call: Callable[[], Any]) -> str:
    """Run `call` (a collective this rank disagrees on): the MismatchError's message, or "no error"."""
    try:
        call()
    except tcoll.MismatchError as exc:
        return str(exc)
    return "no error"


def assert_every_rank_raised(results: list[tuple[str, bool]], what: Any) -> None:
    """Every rank's (message, whether its next call was right): each names the difference and went on."""
    for rank, (said, after_ok) in enumerate(results):
        assert "where rank" in said or "disagree" in said, (what, rank, said)
        assert after_ok, (what, rank)
