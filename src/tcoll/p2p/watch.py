"""Watching a context's blocks of tags: a message of another call, a late message, a notice.

A communicator's collectives share one engine context, and call k talks on
the tags of block k (tags 64k to 64k+63); every message carries the stamp of
its call (tcoll.algos.stamps). A receive posted by the call checks the
stamp of the message it takes (the engine does). What no receive takes is
classified here, as it arrives, against the calls this rank runs:

- a *notice* (stamp bit 63, tag 63 of its block): a control message about
  call k, whose payload says what happened (a rank failed the call, saw a
  disagreement, asks who is in it);
- a message of the call this rank runs in that block, with another stamp:
  the ranks disagree about the call ("mismatch"), or with the same stamp
  while this rank's part of the call takes no messages ("quiet": it runs on
  the shared-memory arena while the sender runs point-to-point);
- a message for a block this rank finished: its call never took it, so the
  sender's call was another ("late"); for a block whose call failed here it
  is only dropped;
- a message for a block this rank has not started: kept, with its stamp, to
  be checked when the call starts.

The engine runs the watcher's `alarm` after its round of progress, never
inside a channel, for every case but the last.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from .work import RecvWork

if TYPE_CHECKING:
    from .matching import Matcher

__all__ = ["BLOCK_BITS", "NOTICE", "NOTICE_TAG", "BlockWatch"]

BLOCK_BITS = 6  # a block is 64 tags: tag >> BLOCK_BITS is the call's sequence number
NOTICE_TAG = 63  # the tag within its block that notices travel on
NOTICE = 1 << 63  # the stamp bit that marks a notice
_NOTICE_BYTES = 1 << 16  # the most of a notice's payload kept

Alarm = Callable[[str, int, int, int, bytes], None]  # (kind, world peer, tag, stamp, payload)


class BlockWatch:
    """What one context's owner (a dispatcher) tells the engine about its calls, and how it is told back.

    Attributes:
        calls: block -> the running call, an object with `stamp` (int), `later` ((first, end) tags of its
            later steps, kept while it is quiet) and `quiet` (bool: this rank
            takes no point-to-point message in it).
        high: the highest block started so far.
        failed: blocks whose call failed here (their late messages are dropped quietly).
        early: block -> [(world peer, stamp)] of messages that came before this rank started the call.
        alarm: called with (kind, world peer, tag, stamp, payload) after the engine's progress.
    """

    __slots__ = ("calls", "high", "failed", "early", "alarm")

    def __init__(self, alarm: Alarm) -> None:
        self.calls: dict[int, Any] = {}
        self.high = 0
        self.failed: deque[int] = deque(maxlen=256)
        self.early: dict[int, list[tuple[int, int]]] = {}
        self.alarm = alarm

    def classify(self, tag: int, stamp: int) -> str | None:
        """What a message that no receive took means: an alarm kind, "drop", or None (keep it for later).

        Kinds: "notice", "mismatch", "quiet", "late"; see the module docstring. No side effect: the
        engine may ask again about a message it left in its channel.
        """
        if stamp & NOTICE:
            return "notice"
        block = tag >> BLOCK_BITS
        call = self.calls.get(block)
        if call is not None:
            if call.stamp != stamp:
                return "mismatch"
            if not call.quiet:
                return None
            first, end = call.later
            return None if first <= tag - (block << BLOCK_BITS) < end else "quiet"  # kept for a later step
        if block <= self.high:
            return "drop" if block in self.failed else "late"
        return None

    def note(self, peer: int, tag: int, stamp: int) -> None:
        """Remember the stamp of a message kept for a call this rank has not started (checked at its start)."""
        block = tag >> BLOCK_BITS
        if block > self.high and block not in self.calls:
            self.early.setdefault(block, []).append((peer, stamp))
            if len(self.early) > 4096:  # a runaway peer: forget the oldest
                self.early.pop(next(iter(self.early)))

    def take(self, matcher: Matcher, kind: str, peer: int, ctx: int, tag: int, nbytes: int, stamp: int) -> RecvWork:
        """Take in a message `classify` found telling (engine lock held); its alarm runs after this round."""
        if kind == "notice":
            kept = nbytes <= _NOTICE_BYTES
            notice = RecvWork(matcher.engine, peer, ctx, tag, np.empty(nbytes, dtype=np.uint8) if kept else None,
                              None, f"notice from rank {peer} (tag {tag})")
            notice.nbytes, notice.seen, notice.watch = nbytes, stamp, self
            return notice  # the matcher raises the alarm once the payload is in
        if kind == "drop":
            return matcher.sink(peer, ctx, tag, nbytes, "late message of a failed call")
        matcher.alarms.append((self, kind, peer, tag, stamp, b""))
        if kind == "late":
            return matcher.sink(peer, ctx, tag, nbytes, "late message of another call")
        return matcher.keep(peer, ctx, tag, nbytes, stamp)  # the call fails; its block is abandoned then
