"""A flight recorder: each rank's last calls, dumped in the pickle format of torch's `fr_trace` tool.

With TCOLL_DUMP=dir, each communicator keeps its last TCOLL_DUMP_ENTRIES calls
(2000 by default) that run through the dispatcher's common path (the
collectives and plans; calls of several steps and object collectives are not
kept); without it the dispatcher's `record` is None and a call pays one test.
A rank writes `dir/tcoll_trace_<rank>` when it closes, and when `tcoll run`
or `tcoll status` prints a hang report (they ask through the job's status
directory). Each entry says its sequence number, collective, sizes, state
(scheduled, or completed), times and the user's source line of the call
under way, so

    python -m torch.distributed.flight_recorder.fr_trace dir

reads a tcoll job as it reads an NCCL one, and names the rank that never
entered a collective the others are stuck in.
"""

from __future__ import annotations

import collections
import os
import pickle
import threading
import time
from typing import Any

from ..p2p.timeline import replace_file

__all__ = ["ENV", "Recorder", "attach", "VERSION"]

ENV = "TCOLL_DUMP"
VERSION = "2.10"  # the dump format of torch 2.13's flight recorder
_PREFIX = "tcoll_trace_"
# fr_trace knows the collectives by torch's names, and libraries by a fixed list (tcoll is not on it): the
# entries say "gloo:<name>", gloo being the CPU library whose calls tcoll's stand in for. Calls it has no
# name for (scan, exscan, the object collectives) are left out of the dump.
_LIBRARY = "gloo"
_NAMES = {name: name for name in ("broadcast", "reduce", "all_gather", "all_reduce", "reduce_scatter", "gather",
                                   "scatter", "all_to_all", "barrier")}
_NAMES.update(all_gatherv="all_gather_v", reduce_scatterv="reduce_scatter_v", all_to_allv="all_to_all_v_single")


class Recorder:
    """The last calls of one communicator (its dispatcher calls `record` as each begins).

    Args:
        world: the world rank of each rank of the communicator.
        rank: this rank's world rank.
        name: the process group's name in the dump ("0" for the world).
        limit: how many calls are kept.
    """

    def __init__(self, world: list[int], rank: int, name: str, limit: int) -> None:
        self.world, self.rank, self.name = world, rank, name
        self.calls: collections.deque[tuple[int, str, int, str, int]] = collections.deque(maxlen=limit)

    def record(self, sequence: int, prepared: Any) -> None:
        """Note call `sequence` as it begins."""
        call = prepared.call
        self.calls.append((sequence, call.label, call.nbytes, prepared.info.name if prepared.info else "",
                           time.time_ns()))

    def entries(self, under_way: set[int], frames: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The calls as flight-recorder entries; `under_way` are still running, `frames` where (innermost first)."""
        found = []
        desc = "default_pg" if self.name == "0" else f"tcoll_group_{self.name}"
        for sequence, label, nbytes, algorithm, began in list(self.calls):
            name = _NAMES.get(label)
            if name is None:
                continue
            running = sequence in under_way
            found.append({
                "record_id": len(found), "pg_id": int(self.name) if self.name.isdigit() else 0,
                "process_group": (self.name, desc), "collective_seq_id": sequence, "p2p_seq_id": 0,
                "op_id": sequence, "profiling_name": f"{_LIBRARY}:{name}", "time_created_ns": began,
                "input_sizes": [[nbytes]], "output_sizes": [[nbytes]], "input_dtypes": ["Byte"],
                "output_dtypes": ["Byte"], "state": "started" if running else "completed",
                "time_discovered_started_ns": began, "time_discovered_completed_ns": None if running else began,
                "retired": not running, "timeout_ms": 0, "is_p2p": False, "algorithm": algorithm,
                "thread_id": str(threading.get_ident()), "thread_name": "python",
                "frames": frames if running else [],
            })
        return found

    def dump(self, directory: str, under_way: set[int], frames: list[dict[str, Any]]) -> str:
        """Write this rank's dump (the world's calls) into `directory`; its path."""
        entries = self.entries(under_way, frames)
        last = max((e["collective_seq_id"] for e in entries), default=-1)
        done = max((e["collective_seq_id"] for e in entries if e["retired"]), default=-1)
        data = {"version": VERSION, "comm_lib_version": "tcoll", "entries": entries,
                "pg_config": {self.name: {"name": self.name, "desc": "default_pg" if self.name == "0" else self.name,
                                          "ranks": str(list(self.world))}},
                "pg_status": {self.name: {"last_enqueued_collective": last, "last_started_collective": last,
                                          "last_completed_collective": done}}}
        path = os.path.join(directory, f"{_PREFIX}{self.rank}")
        replace_file(path, pickle.dumps(data), 0o600)  # a new file: a planted link is replaced, not followed
        return path


def limit() -> int:
    """TCOLL_DUMP_ENTRIES: the calls each rank keeps (2000 by default)."""
    try:
        return max(1, int(os.environ.get("TCOLL_DUMP_ENTRIES", "2000")))
    except ValueError:
        return 2000


def attach(dispatcher: Any, world: list[int], rank: int) -> Recorder | None:
    """Keep the calls of a world communicator's dispatcher when TCOLL_DUMP is set; the Recorder, or None."""
    if not os.environ.get(ENV):
        return None
    recorder = Recorder(world, rank, "0", limit())
    dispatcher.record = recorder.record
    return recorder


def dump(recorder: Recorder, dispatcher: Any, frames: list[dict[str, Any]]) -> str | None:
    """Write the dump of `recorder` into TCOLL_DUMP (None when unset); `dispatcher` tells the calls under way."""
    directory = os.environ.get(ENV)
    if not directory:
        return None
    try:
        under_way = set(dispatcher.agreement.watch.calls)
    except RuntimeError:
        under_way = set()
    try:
        return recorder.dump(directory, under_way, frames)
    except OSError:
        return None  # the directory cannot be written: the job goes on without its dump
