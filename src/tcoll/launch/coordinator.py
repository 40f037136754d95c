"""How the launchers of a multi-node job talk to each other through the tcoll store.

Keys, all under ``tcoll/launch/`` (the ranks' own keys live elsewhere):

- ``run_id``, ``nprocs``, ``keep_going``: set by node 0; the other nodes adopt
  the run id and check that they start as many ranks, and agree on --keep-going.
- ``status/<node>``: ``running``, ``succeeded``, ``ended`` (every rank ended,
  some failed: --keep-going), ``failed`` or ``interrupted``.
- ``abort``: JSON ``{"node", "rank", "code", "reason"}``, set by the first
  launcher that sees a local rank fail (or is interrupted); every launcher
  watches it and stops its ranks when it appears.
- ``beat/<node>``: a counter each launcher bumps about once a second, so node 0
  (which must keep the store up until every node is done) notices a launcher
  that died without a word.
- ``done/<node>``: 1 once all the ranks of that node exited 0 (or, with
  --keep-going, exited at all).
- ``rows/<node>``: JSON, the hang report's rows of the ranks on that node
  (tcoll.launch.hangs.HangWatch), rewritten when they change.
- ``dump``: a counter a launcher bumps when its report asks every rank for its
  flight-recorder dump.
- ``failures`` and ``failure/<n>`` (n = 1, 2, ...): with --keep-going, where a
  launcher records each local rank that failed (JSON as ``abort``, n from the
  counter, so ``failure/1`` is the job's first), instead of announcing an abort.
"""

from __future__ import annotations

import builtins
import dataclasses
import functools
import json
import threading
import time
from collections.abc import Callable
from typing import Any

from tcoll.launch.config import LaunchConfig

__all__ = ["PREFIX", "NodeCoordinator", "RemoteFailure", "connect_store"]

PREFIX = "tcoll/launch/"
_ABORT = PREFIX + "abort"
_FAILURES = PREFIX + "failures"
_WATCH_PERIOD = 1.0  # seconds a watcher blocks on the abort key between heartbeats
# Seconds a store request may take before the store counts as lost. A host that
# vanished without closing its sockets fails the connection sooner, after
# TCOLL_TCP_DEAD_AFTER (tcoll.keepalive); this catches a store that hangs.
_REQUEST_TIMEOUT = 15.0


@dataclasses.dataclass(frozen=True)
class RemoteFailure:
    """A failure announced by some launcher through the ``abort`` key.

    Attributes:
        node: the node whose launcher announced it.
        rank: the global rank that failed (-1 when a whole node was interrupted).
        code: the exit code that launcher returns.
        reason: e.g. ``"exited with code 3"``.
    """

    node: int
    rank: int
    code: int
    reason: str


def _text(value: Any) -> str:
    """Decode a store value to text, whether the store returns bytes or str."""
    return value.decode() if isinstance(value, (bytes, bytearray)) else str(value)


def _failure(raw: Any) -> RemoteFailure:
    """Decode the JSON of an ``abort`` or ``failure/<n>`` key."""
    info = json.loads(_text(raw))
    return RemoteFailure(int(info["node"]), int(info["rank"]), int(info["code"]), str(info["reason"]))


def connect_store(host: str, port: int, timeout: float, connect_timeout: float,
                  auth_key: str | None = None) -> Any:
    """Connect a `tcoll.store.tcp.TCPStore` client (it retries until `connect_timeout`).

    Args:
        host: the store's host.
        port: the store's port.
        timeout: the client's default timeout for each request.
        connect_timeout: seconds to keep trying to connect (node 0 may start later).
        auth_key: the job's shared secret (TCOLL_AUTH_KEY), if any.

    Returns:
        The connected client.

    Raises:
        tcoll.RendezvousError: the store could not be reached in time, or refused the key.
    """
    from tcoll.store.tcp import TCPStore

    return TCPStore(host, port, timeout=timeout, connect_timeout=connect_timeout, auth_key=auth_key)


class NodeCoordinator:
    """One launcher's link to the others: status, abort announcements and heartbeats.

    Two client connections: one used by the launcher's main thread, one owned
    by the watcher thread, so neither has to share a socket.

    Args:
        config: this node's configuration (master address, node rank, nnodes).
        notify: called (from the watcher thread) whenever it learns something:
            a failure or a lost store.
        connect: makes a store client from (host, port, request timeout, connect
            timeout); default `connect_store` (with no authentication key).
    """

    def __init__(self, config: LaunchConfig, notify: Callable[[], None],
                 connect: Callable[[str, int, float, float], Any] = connect_store) -> None:
        self._config = config
        self._notify = notify
        self._connect = connect
        self._main: Any = None
        self._watcher_store: Any = None
        self._thread: threading.Thread | None = None
        self._closing = threading.Event()
        self._beats: dict[int, tuple[int, float]] = {}
        self._seen_failures = 0  # failure/<n> keys the watcher has read
        self._remote_failures: list[RemoteFailure] = []  # appended by the watcher, taken by the main thread
        self.failure: RemoteFailure | None = None
        self.lost = ""

    def join(self) -> str:
        """Connect to the store, agree on the run id and start watching for aborts.

        Returns:
            The run id of the job (node 0's).

        Raises:
            tcoll.RendezvousError: the store is unreachable.
            tcoll.TimeoutError: node 0 did not publish the run id within `join_timeout`.
            ValueError: this node disagrees with node 0 (run id, ranks per node).
        """
        cfg = self._config
        where = (cfg.master_addr, cfg.master_port)
        self._main = self._connect(*where, _REQUEST_TIMEOUT, cfg.join_timeout)
        self._watcher_store = self._connect(*where, _REQUEST_TIMEOUT, cfg.join_timeout)
        if cfg.node_rank == 0:
            self._main.set(PREFIX + "nprocs", str(cfg.nprocs).encode())
            self._main.set(PREFIX + "keep_going", str(int(cfg.keep_going)).encode())
            self._main.set(PREFIX + "run_id", cfg.run_id.encode())  # last: the others wait for it
            run_id = cfg.run_id
        else:
            run_id = _text(self._main.get(PREFIX + "run_id", timeout=cfg.join_timeout))
            nprocs = int(_text(self._main.get(PREFIX + "nprocs", timeout=cfg.join_timeout)))
            keep_going = _text(self._main.get(PREFIX + "keep_going", timeout=cfg.join_timeout)) == "1"
            if cfg.run_id and cfg.run_id != run_id:
                raise ValueError(f"--run-id {cfg.run_id} differs from node 0's {run_id}")
            if nprocs != cfg.nprocs:
                raise ValueError(f"node 0 starts {nprocs} ranks per node, this node {cfg.nprocs}: "
                                 "every node needs the same -n")
            if keep_going != cfg.keep_going:
                raise ValueError(f"node 0 runs {'with' if keep_going else 'without'} --keep-going, this node "
                                 f"{'with' if cfg.keep_going else 'without'}: every node needs the same")
        self.publish("running")
        self._thread = threading.Thread(target=self._watch, name="tcoll-launch-watch", daemon=True)
        self._thread.start()
        return run_id

    def _watch(self) -> None:
        """Block on the abort key; bump this node's heartbeat between waits."""
        beat = f"{PREFIX}beat/{self._config.node_rank}"
        while not self._closing.is_set():
            began = time.monotonic()
            try:
                self._watcher_store.add(beat, 1)
                if self._config.keep_going:
                    self._read_failures()
                raw = self._watcher_store.get(_ABORT, timeout=_WATCH_PERIOD)
            except builtins.TimeoutError as exc:
                if time.monotonic() - began < _WATCH_PERIOD + _REQUEST_TIMEOUT / 2:
                    continue  # the key is not set yet: the normal case
                if not self._closing.is_set():  # the store stopped answering at all
                    self.lost = f"no answer for {time.monotonic() - began:.0f} s: {exc}"
                    self._notify()
                return
            except Exception as exc:  # noqa: BLE001 - any store error means the link is gone
                if not self._closing.is_set():
                    self.lost = f"{type(exc).__name__}: {exc}"
                    self._notify()
                return
            failure = _failure(raw)
            if failure.node != self._config.node_rank:
                self.failure = failure
                self._notify()
            return

    def _read_failures(self) -> None:
        """(Watcher thread) Collect the failures other launchers recorded since the last look."""
        count = int(self._watcher_store.add(_FAILURES, 0))
        while self._seen_failures < count:
            self._seen_failures += 1
            failure = _failure(self._watcher_store.get(f"{PREFIX}failure/{self._seen_failures}",
                                                       timeout=_REQUEST_TIMEOUT))
            if failure.node != self._config.node_rank:
                self._remote_failures.append(failure)
                self._notify()

    def note_failure(self, rank: int, code: int, reason: str) -> None:
        """With keep_going: record a local rank's failure for the other launchers (best effort).

        Args:
            rank: the failed global rank.
            code: its exit code (128 + N for signal N).
            reason: e.g. ``"was killed by SIGKILL"``.
        """
        info = json.dumps({"node": self._config.node_rank, "rank": rank, "code": code, "reason": reason}).encode()
        number = self._best_effort(functools.partial(self._main.add, _FAILURES, 1))
        if number is not None:
            self._best_effort(functools.partial(self._main.set, f"{PREFIX}failure/{number}", info))

    def take_failures(self) -> list[RemoteFailure]:
        """The failures on other nodes the watcher found since the last call (keep_going only)."""
        taken = len(self._remote_failures)
        found, self._remote_failures[:taken] = self._remote_failures[:taken], []
        return found

    def first_failure(self) -> RemoteFailure | None:
        """The job's first recorded failure on any node (keep_going), or None (also without the store)."""
        if not self._best_effort(functools.partial(self._main.add, _FAILURES, 0)):
            return None
        raw = self._best_effort(functools.partial(self._main.get, f"{PREFIX}failure/1", timeout=_REQUEST_TIMEOUT))
        return None if raw is None else _failure(raw)

    def publish(self, status: str) -> None:
        """Record this node's status in the store (best effort: the store may be gone).

        Args:
            status: ``running``, ``succeeded``, ``ended`` (keep_going: every rank ended, some
                failed), ``failed`` or ``interrupted``.
        """
        self._best_effort(lambda: self._main.set(f"{PREFIX}status/{self._config.node_rank}",
                                                 status.encode()))
        if status in ("succeeded", "ended"):
            self._best_effort(lambda: self._main.add(f"{PREFIX}done/{self._config.node_rank}", 1))

    def abort(self, rank: int, code: int, reason: str) -> None:
        """Tell every launcher to stop its ranks (best effort; the first announcement wins).

        Args:
            rank: the failing global rank, or -1 for the whole node.
            code: the exit code this launcher returns.
            reason: e.g. ``"exited with code 3"``.
        """
        info = {"node": self._config.node_rank, "rank": rank, "code": code, "reason": reason}
        self._best_effort(lambda: self._main.compare_set(_ABORT, b"", json.dumps(info).encode()))

    def share_rows(self, rows: list[dict[str, Any]]) -> None:
        """Publish the hang report's rows of this node's ranks (best effort)."""
        value = json.dumps(rows).encode()
        self._best_effort(lambda: self._main.set(f"{PREFIX}rows/{self._config.node_rank}", value))

    def rows(self) -> list[dict[str, Any]]:
        """The rows the other nodes published last (those that published any; none if the store fails)."""
        keys = [f"{PREFIX}rows/{node}" for node in range(self._config.nnodes) if node != self._config.node_rank]
        if self._best_effort(lambda: self._main.check(keys)):
            values = self._best_effort(lambda: self._main.multi_get(keys, timeout=_REQUEST_TIMEOUT)) or []
        else:  # a node has published nothing yet: the others one by one
            values = [self._best_effort(lambda key=key: self._main.get(key, timeout=_REQUEST_TIMEOUT)
                                        if self._main.check([key]) else None) for key in keys]
        found = []
        for value in values:
            if value:
                try:
                    found.extend(json.loads(_text(value)))
                except ValueError:
                    continue
        return found

    def ask_dump(self) -> None:
        """Ask every node's ranks for their flight-recorder dumps (best effort)."""
        self._best_effort(lambda: self._main.add(f"{PREFIX}dump", 1))

    def dumps_asked(self) -> int:
        """How many times a launcher asked for dumps so far (0 if the store fails)."""
        return int(self._best_effort(lambda: self._main.add(f"{PREFIX}dump", 0)) or 0)

    def pending_nodes(self) -> list[int]:
        """List the nodes whose ranks have not all exited 0 yet (all of them if the store fails)."""
        pending = []
        for node in range(self._config.nnodes):
            done = self._best_effort(functools.partial(self._main.add, f"{PREFIX}done/{node}", 0))
            if not done:
                pending.append(node)
        return pending

    def silent_node(self, nodes: list[int], limit: float) -> int | None:
        """Find a node whose launcher stopped bumping its heartbeat.

        Args:
            nodes: the nodes to check (those still running).
            limit: seconds of silence that mean a launcher is gone; a launcher
                never heard from gets `join_timeout` instead (it may start late).

        Returns:
            The first silent node, or None when all are alive.
        """
        now = time.monotonic()
        for node in nodes:
            count = self._best_effort(functools.partial(self._main.add, f"{PREFIX}beat/{node}", 0))
            last = self._beats.get(node)
            if last is None or (count is not None and count != last[0]):
                self._beats[node] = (count if count is not None else -1, now)
                continue
            allowed = limit if last[0] > 0 else self._config.join_timeout
            if now - last[1] > allowed:
                return node
        return None

    def _best_effort(self, action: Callable[[], Any]) -> Any:
        """Run a store call, returning None instead of raising when the store is gone."""
        if self._main is None:
            return None
        try:
            return action()
        except Exception:  # noqa: BLE001 - reporting continues without the store
            return None

    def close(self) -> None:
        """Stop the watcher and close both connections."""
        self._closing.set()
        for client in (self._watcher_store, self._main):
            if client is not None:
                self._best_effort(client.close)
        if self._thread is not None:
            self._thread.join(timeout=2 * _WATCH_PERIOD + 1)
