"""How the watch classifies a message no receive took, for a call that runs on the arena."""

from __future__ import annotations

from tcoll.comm.agreement import ARENA_TAGS, Running
from tcoll.p2p.watch import BLOCK_BITS, BlockWatch


def _watch_with(running: Running) -> BlockWatch:
    watch = BlockWatch(lambda *args: None)
    watch.calls[running.sequence] = running
    watch.high = running.sequence
    return watch


def test_a_quiet_program_step_keeps_what_peers_send_for_its_later_steps() -> None:
    """Step 0 on the arena; a fast peer already sends step 1 over point-to-point: kept, not a mismatch."""
    running = Running(5, "scatter", stamp=1234, quiet=True)
    running.later = (16, ARENA_TAGS)  # step 0 is phases 0-1 (tags 0-15)
    watch = _watch_with(running)
    base = 5 << BLOCK_BITS
    assert watch.classify(base + 16, 1234) is None  # step 1's message: kept for it
    assert watch.classify(base + 3, 1234) == "quiet"  # step 0 itself over point-to-point: the ranks differ
    assert watch.classify(base + ARENA_TAGS, 1234) == "quiet"  # a peer reopening the arena
    assert watch.classify(base + 16, 999) == "mismatch"  # another call altogether


def test_a_quiet_single_call_keeps_nothing() -> None:
    watch = _watch_with(Running(2, "all_reduce", stamp=7, quiet=True))
    assert watch.classify((2 << BLOCK_BITS) + 16, 7) == "quiet"
