"""What the collective calls of one rank are at, for the hang report (tcoll.p2p.status, tcoll.p2p.reporter).

Read from another thread, about once a second, from what the dispatchers keep
anyway: the sequence number, the calls under way (the agreement's watch), and
the last call run through the common path (`Dispatcher.current`, one attribute
set per call). Nothing here runs on a call's path.
"""

from __future__ import annotations

from typing import Any

__all__ = ["calls"]


def _describe(dispatcher: Any) -> dict[str, Any]:
    """One communicator's calls: the one under way (or None), and the last one numbered."""
    sequence = dispatcher.sequence
    current = dispatcher.current
    running = sorted(list(dispatcher.agreement.watch.calls.values()), key=lambda entry: entry.sequence)
    state: dict[str, Any] = {"size": dispatcher.size, "rank": dispatcher.rank, "sequence": sequence, "call": None,
                             "last": None}
    if dispatcher.size != dispatcher.engine.size:  # a split's: the report names its members
        state["members"] = list(dispatcher.world)
    if current is not None and current[0] == sequence:
        state["last"] = current[1].call.label
    if running:
        entry = running[-1]  # the latest call under way (earlier ones are asynchronous Works)
        call: dict[str, Any] = {"label": entry.label, "sequence": entry.sequence, "algorithm": "", "bytes": None,
                                "under_way": len(running)}
        if current is not None and current[0] == entry.sequence:
            prepared = current[1]
            call["algorithm"] = prepared.info.name if prepared.info is not None else ""
            call["bytes"] = prepared.call.nbytes
        work = entry.work
        if work is not None:
            call["work"] = work.description  # e.g. "all_reduce #4 (ring, 8 B per rank)"
        state["call"] = call
    return state


def calls(engine: Any) -> list[dict[str, Any]]:
    """The calls of every live communicator of `engine` (the world's first), as the hang report shows them.

    Returns:
        A list of dicts: size, rank (in that communicator), members (the world ranks of a communicator
        smaller than the world, else absent), sequence (calls numbered so far), last (the
        label of the last call numbered, if known), call (the one under way: label, sequence, algorithm,
        bytes, work; or None).
    """
    found = []
    for ref in list(engine.callers):
        dispatcher = ref()
        if dispatcher is None or dispatcher.closed:
            continue
        try:
            found.append(_describe(dispatcher))
        except (RuntimeError, AttributeError):  # changed under us while the call moved on: the next look sees it
            continue
    return found
