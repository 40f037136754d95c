"""The hang report: a row per rank (its call, what it waits for, its source line, how long), then a verdict.

Read from the files the ranks publish (tcoll.p2p.status, tcoll.p2p.reporter),
by `tcoll run` (after TCOLL_HANG_REPORT seconds without progress, on Ctrl-C,
on SIGUSR1) and by `tcoll status`. With several hosts, every launcher sends
its host's rows to the others through the job's store, and node 0's keeps
them beside its host's files, so both see the whole job. The verdict names the culprit in words:
the rank the others wait for that waits for nobody (asleep in user code, in
another call, stopped), or a cycle of ranks that wait for each other.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import time
from typing import Any

from tcoll.p2p import status

__all__ = ["Rank", "report", "verdict", "quiet_for", "progress_key", "job_states", "running_jobs", "remove_job",
           "ask_dump", "HangWatch", "hang_after", "OTHER_HOSTS"]


class Rank:
    """One rank's row, derived from its published state.

    Attributes:
        rank: its world rank.
        state: what it published.
        call: the call it is in ("all_reduce #4 (shm, 16 B)"), or "" when it is in none.
        idle: "no call since all_reduce #3" when it is in none.
        peers: the world ranks it waits for.
        detail: the tag or arena step it waits for.
        waited: seconds in this state.
        stopped: its process is stopped (SIGSTOP, a debugger).
    """

    def __init__(self, state: dict[str, Any], now: float) -> None:
        self.rank, self.state = int(state["rank"]), state
        noted = state.get("waiting")
        comms = state.get("comms") or []
        under_way = [c for c in comms if c.get("call")]
        self.call, self.idle = "", ""
        self.label = ""
        if under_way:
            call = under_way[0]["call"]
            members = under_way[0].get("members")  # a split's call: say among whom
            self.label = f"{call['label']} #{call['sequence']}" + (f" among {_ranks(members)}" if members else "")
            how = [part for part in (call.get("algorithm"), _bytes(call.get("bytes"))) if part]
            self.call = self.label + (f" ({', '.join(how)})" if how else "")
        elif noted:
            self.call = self.label = noted["what"]
        elif state.get("in_tcoll"):
            self.call = self.label = "in tcoll (point-to-point)"
        else:
            world = comms[0] if comms else {"sequence": 0, "last": None}
            last = f"{world['last'] or 'call'} #{world['sequence']}"
            self.idle = f"no call since {last}" if world["sequence"] else "no call yet"
        self.peers: list[int] = sorted(noted["peers"]) if noted else []
        self.detail = noted["detail"] if noted else ""
        self.recv = bool(noted) and noted["what"].startswith("recv")
        self.waited = now - float(noted["since"] if noted else state.get("since", now))
        self.stopped = _stopped(state)

    @property
    def at(self) -> str:
        """Where its user code is: "job.py:7 (time.sleep(100))"."""
        code = self.state.get("code") or ""
        return (self.state.get("where") or "") + (f" ({code})" if code else "")

    @property
    def spot(self) -> str:
        """`at` for a sentence: a rank's stack is read only a tick after it stopped moving, so it may be unknown."""
        return self.at or "a line not sampled yet"


def _bytes(count: Any) -> str:
    return "" if count is None else f"{count} B"


def _stopped(state: dict[str, Any]) -> bool:
    """Whether the rank's process is stopped: state T or t in /proc/<pid>/stat (another host's launcher looked)."""
    if state.get("host") != socket.gethostname():
        return bool(state.get("stopped"))  # set by the launcher of its host, which sent its row (HangWatch)
    try:
        with open(f"/proc/{int(state['pid'])}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] in ("T", "t")
    except (OSError, ValueError, IndexError, KeyError):
        return False


def _alive(state: dict[str, Any]) -> bool:
    if state.get("host") != socket.gethostname():
        return True  # another host's rank: cannot tell from here
    return os.path.exists(f"/proc/{int(state.get('pid', 0))}")


def _ranks(numbers: list[int], verb: str = "") -> str:
    """"rank 2", "ranks 0 and 1", "ranks 0, 1 and 3"; with a verb, it agrees: "rank 2 waits", "ranks 0 and 1 wait"."""
    words = [str(n) for n in sorted(numbers)]
    if len(words) == 1:
        return f"rank {words[0]}" + (f" {verb}s" if verb else "")
    return f"ranks {', '.join(words[:-1])} and {words[-1]}" + (f" {verb}" if verb else "")


def _waiting_on(rows: dict[int, Rank], culprit: int) -> list[int]:
    """The ranks that wait for `culprit`, directly or through others that wait."""
    found: set[int] = set()
    todo = [culprit]
    while todo:
        target = todo.pop()
        for row in rows.values():
            if target in row.peers and row.rank not in found and row.rank != culprit:
                found.add(row.rank)
                todo.append(row.rank)
    return sorted(found)


def _cycle(rows: dict[int, Rank]) -> list[int]:
    """A cycle of ranks that each wait for the next (smallest first), or []."""
    for start in sorted(rows):
        path, seen = [start], {start}
        node = start
        while rows.get(node) is not None and rows[node].peers:
            node = rows[node].peers[0] if len(rows[node].peers) == 1 else next(
                (p for p in rows[node].peers if p in rows and rows[p].peers), rows[node].peers[0])
            if node == start:
                return path
            if node in seen or node not in rows:
                break
            path.append(node)
            seen.add(node)
    return []


def _chain(rows: dict[int, Rank], cycle: list[int]) -> str:
    """A cycle of ranks in different calls in words: "rank 2 in barrier #1 (job.py:7) waits for rank 3, which is in
    all_reduce #5 (job.py:8) and waits for rank 2"."""
    words = []
    for k, rank in enumerate(cycle):
        row, then = rows[rank], cycle[(k + 1) % len(cycle)]
        where = row.state.get("where", "?")
        words.append(f"rank {rank} in {row.label} ({where}) waits for rank {then}" if k == 0 else
                     f", which is in {row.label} ({where}) and waits for rank {then}")
    return "".join(words)


def verdict(rows: dict[int, Rank], size: int, exited: dict[int, str] | None = None) -> str:
    """The culprit in words (see the module docstring).

    Args:
        rows: the live ranks' rows.
        size: the world size.
        exited: how ranks known to have ended did ("was killed by SIGKILL"), where the launcher saw it.
    """
    exited = exited or {}
    waited_on = sorted({peer for row in rows.values() for peer in row.peers})
    for peer in waited_on:
        if peer not in rows and peer in exited:
            return f"rank {peer} {exited[peer]} (its process is gone); {_ranks(_waiting_on(rows, peer), 'wait')} for it"
    for peer in waited_on:
        if peer not in rows:
            return f"rank {peer} has published nothing (it is gone, or never joined); " \
                   f"{_ranks(_waiting_on(rows, peer), 'wait')} for it"
    for row in sorted(rows.values(), key=lambda r: (not r.stopped, r.rank)):
        if row.peers and not row.stopped:
            continue
        waiters = _waiting_on(rows, row.rank)
        if not waiters and not row.stopped:
            continue
        calls = sorted({rows[w].label for w in waiters if rows[w].label})
        tail = (f"; {_ranks(waiters, 'wait')} for it" + (f" in {' and '.join(calls)}" if calls else "")
                if waiters else "")
        if row.stopped:  # its sampler is stopped too: its row is the last it wrote
            inside = f" in {row.label}" if row.label else ""
            return f"rank {row.rank} is stopped (SIGSTOP or a debugger: it does not answer), " \
                   f"last seen{inside} at {row.spot}{tail}"
        if row.idle:
            return f"rank {row.rank} has made {row.idle}, and is at {row.spot}{tail}"
        return f"rank {row.rank} is in {row.call} at {row.spot}{tail}"
    cycle = _cycle(rows)
    if cycle:
        waiters = sorted({w for r in cycle for w in _waiting_on(rows, r)} - set(cycle))
        calls = sorted({rows[w].label for w in waiters if rows[w].label})
        tail = f"; {_ranks(waiters, 'wait')} for them" + (f" in {' and '.join(calls)}" if calls else "") \
            if waiters else ""
        if len(cycle) == 2 and all(rows[r].recv for r in cycle):
            tags = sorted({rows[r].detail for r in cycle if rows[r].detail})
            return f"{_ranks(cycle)} each wait to receive from the other ({', '.join(tags)}): a deadlock{tail}"
        if len({rows[r].label for r in cycle}) > 1:
            return f"a deadlock across calls: {_chain(rows, cycle)}{tail}"
        chain = " -> ".join(str(r) for r in [*cycle, cycle[0]])
        return f"{_ranks(cycle)} wait for each other ({chain}): a deadlock{tail}"
    if any(row.call for row in rows.values()):
        return "no rank waits for a rank that is not itself waiting: the ranks may still be moving"
    return "no rank is in a tcoll call"


def report(job: str, states: list[dict[str, Any]], now: float | None = None,
           exited: dict[int, str] | None = None) -> str:
    """The report of one job: a header, a row per rank, and the verdict.

    Args:
        job: the run id.
        states: the live ranks' published states.
        now: the time to measure waits against (default: now).
        exited: ranks that ended, and how ("exited with code 0"), as the launcher saw them;
            their rows and the verdict say so instead of treating them as silent.
    """
    now = time.time() if now is None else now
    exited = {rank: how for rank, how in (exited or {}).items() if rank not in {int(s["rank"]) for s in states}}
    rows = {row.rank: row for row in (Rank(state, now) for state in states)}
    size = max([int(s.get("size", 0)) for s in states] + [0])
    quiet = quiet_for(states, now)
    table = [("rank", "call", "waits for", "at", "waited")]
    for rank in range(size):
        row = rows.get(rank)
        if row is None:
            table.append((str(rank), f"(ended: {exited[rank]})" if rank in exited else "(published nothing)",
                          "", "", ""))
            continue
        waits = (f"{_ranks(row.peers)}" + (f" ({row.detail})" if row.detail else "")) if row.peers else "-"
        what = (row.call or row.idle) + (" [stopped]" if row.stopped else "")
        table.append((str(rank), what, waits, row.at, f"{row.waited:.0f} s"))
    widths = [max(len(line[k]) for line in table) for k in range(5)]
    ended = f"{len(exited)} ended; " if exited else ""
    lines = [f"tcoll: hang report for job {job} ({len(rows)} of {size} ranks published; {ended}"
             f"no progress for {quiet:.0f} s)"]
    for line in table:
        lines.append("  " + "  ".join([line[0].rjust(widths[0]), *(line[k].ljust(widths[k]) for k in (1, 2, 3)),
                                       line[4].rjust(widths[4])]).rstrip())
    lines.append(f"verdict: {verdict(rows, size, exited)}")
    return "\n".join(lines)


def quiet_for(states: list[dict[str, Any]], now: float | None = None) -> float:
    """Seconds since any rank last changed state (0 without states)."""
    now = time.time() if now is None else now
    return max(0.0, now - max(float(s.get("since", now)) for s in states)) if states else 0.0


def progress_key(states: list[dict[str, Any]]) -> Any:
    """What must change for a later report to be new."""
    return tuple((s["rank"], s.get("since"), _stopped(s)) for s in states)


def stuck(states: list[dict[str, Any]]) -> bool:
    """Whether some rank waits inside tcoll (a job whose ranks all compute is not hung)."""
    return any(s.get("in_tcoll") or s.get("waiting") for s in states)


OTHER_HOSTS = "hosts.json"
"""The file, beside the ranks' own, in which node 0's launcher keeps the rows the other hosts' launchers sent."""


def job_states(job: str, directory: str | None = None, others: bool = True) -> list[dict[str, Any]]:
    """The published states of job `job` whose processes still live.

    Args:
        job: the run id.
        directory: where they are published (default: this user's directory for `job`).
        others: add the other hosts' rows that the launcher of node 0 keeps here (while it lives).
    """
    directory = directory or status.job_dir(job)
    local = [s for s in status.read_job(directory) if _alive(s)]
    if not others:
        return local
    ranks = {int(s["rank"]) for s in local}
    return sorted(local + [s for s in _other_hosts(directory) if int(s["rank"]) not in ranks],
                  key=lambda state: int(state["rank"]))


def _other_hosts(directory: str) -> list[dict[str, Any]]:
    """The other hosts' rows kept in `directory` by a launcher that still lives ([] if none)."""
    try:
        with open(os.path.join(directory, OTHER_HOSTS)) as source:
            kept = json.load(source)
        if _alive({"host": kept["host"], "pid": kept["launcher"]}):
            return [s for s in kept["states"] if isinstance(s, dict) and "rank" in s]
    except (OSError, ValueError, KeyError, TypeError):
        pass
    return []


def running_jobs() -> dict[str, str]:
    """This user's jobs with a live rank: job id -> directory (stale directories are removed)."""
    found = {}
    for base in status.bases():
        try:
            names = sorted(os.listdir(base))
        except OSError:
            continue
        for name in names:
            directory = os.path.join(base, name)
            states = status.read_job(directory)
            if any(_alive(s) for s in states) or _other_hosts(directory):
                found.setdefault(name, directory)
            elif states or os.path.exists(os.path.join(directory, OTHER_HOSTS)):
                shutil.rmtree(directory, ignore_errors=True)  # every rank of it, and its launcher, is gone (killed)
            elif _older_than(directory, 60.0):
                _rmdir(directory)  # empty for a minute: no rank is about to publish there
    return found


def ask_dump(job: str, directory: str | None = None) -> None:
    """Ask the ranks of job `job` to write their flight-recorder dumps (those that run with TCOLL_DUMP)."""
    path = os.path.join(directory or status.job_dir(job), "dump")
    try:
        with open(path, "a"):
            pass
        os.utime(path)
    except OSError:
        pass


def _older_than(path: str, seconds: float) -> bool:
    try:
        return time.time() - os.stat(path).st_mtime > seconds
    except OSError:
        return False


def _rmdir(path: str) -> None:
    try:
        os.rmdir(path)
    except OSError:
        pass  # a rank published meanwhile


def remove_job(job: str) -> None:
    """Remove job `job`'s directory (the launcher's cleanup)."""
    for base in status.bases():
        shutil.rmtree(os.path.join(base, job), ignore_errors=True)


class HangWatch:
    """The launcher's eye on its job: a report after `after` s without progress, or when asked.

    With several nodes, every launcher sends its host's rows to the others through `nodes` (the
    launchers' link, tcoll.launch.coordinator.NodeCoordinator: share_rows, rows, ask_dump,
    dumps_asked), so a report shows every rank of the job; only node 0 (`primary`) reports by itself.

    Args:
        job: the run id.
        after: seconds without progress before a report (TCOLL_HANG_REPORT; 0: only when asked).
        say: prints a report.
        nodes: the link to the other nodes' launchers (None: a job of one node).
        primary: whether this launcher reports a hang by itself (node 0's).
    """

    def __init__(self, job: str, after: float, say: Any, nodes: Any = None, primary: bool = True) -> None:
        self.job, self.after, self.say, self.nodes, self.primary = job, after, say, nodes, primary
        self.next_look = 0.0
        self.reported: Any = None
        self.shared: Any = None  # the rows this node sent last
        self.dumps = 0  # the other nodes' requests for dumps, served so far
        self.kept: Any = None  # the other hosts' rows last written beside this host's (OTHER_HOSTS)
        self.exited: dict[int, str] = {}  # set by the launcher as ranks end: rank -> "was killed by SIGKILL"

    def check(self) -> None:
        """Look at the ranks about once a second; report a hang once per state of the job."""
        if time.monotonic() < self.next_look or (self.after <= 0 and self.nodes is None):
            return
        self.next_look = time.monotonic() + 1.0
        local = job_states(self.job, others=False)
        if self.nodes is not None:
            self._share(local)
        if not self.primary:
            return
        states = self._whole_job(local)
        if self.after <= 0 or not states or not stuck(states) or quiet_for(states) < self.after:
            return
        key = progress_key(states)
        if key != self.reported:
            self.reported = key
            self._report(states)

    def report_now(self, only_if_stuck: bool = False) -> None:
        """Report at once (SIGUSR1, Ctrl-C), if the ranks published anything."""
        states = self._whole_job(job_states(self.job, others=False))
        if states and (stuck(states) or not only_if_stuck):
            self.reported = progress_key(states)
            self._report(states)

    def _report(self, states: list[dict[str, Any]]) -> None:
        self.say(report(self.job, states, exited=self.exited))
        ask_dump(self.job)
        if self.nodes is not None:
            self.nodes.ask_dump()  # the other hosts' ranks dump too

    def _share(self, local: list[dict[str, Any]]) -> None:
        """Send this host's rows to the other launchers when they changed; serve their requests for dumps."""
        rows = [dict(state, stopped=_stopped(state)) for state in local]  # only this host can tell
        if rows != self.shared:
            self.shared = rows
            self.nodes.share_rows(rows)
        asked = self.nodes.dumps_asked()
        if asked > self.dumps:
            self.dumps = asked
            ask_dump(self.job)

    def _whole_job(self, local: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The states of every rank of the job: this host's, and those the other launchers sent."""
        if self.nodes is None:
            return local
        ranks = {int(state["rank"]) for state in local}
        others = [s for s in self.nodes.rows() if int(s["rank"]) not in ranks]
        if others != self.kept:  # kept beside this host's rows, for `tcoll status` on this host
            self.kept = others
            try:
                status.write(os.path.join(status.job_dir(self.job, create=True), OTHER_HOSTS),
                             {"launcher": os.getpid(), "host": socket.gethostname(), "states": others})
            except OSError:
                pass
        return sorted(local + others, key=lambda state: int(state["rank"]))


def hang_after(env: dict[str, str]) -> float:
    """TCOLL_HANG_REPORT from `env` or this process's environment: seconds (default 60; 0: off)."""
    text = env.get("TCOLL_HANG_REPORT", os.environ.get("TCOLL_HANG_REPORT", "60"))
    try:
        return max(0.0, float(text))
    except ValueError:
        return 60.0
