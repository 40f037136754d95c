"""Start the ranks of one node, watch them, stop them all when one fails, and clean up.

With ``keep_going`` (``tcoll run --keep-going``) a failed rank is reported and
the others run on to their own end; the launcher then returns the failure's code.

The node's launcher hosts the tcoll store when it is node 0, starts every
rank with the environment of `tcoll.launch.config`, forwards its output
through `tcoll.launch.output`, and with several nodes keeps in touch with the
other launchers through `tcoll.launch.coordinator`.
"""

from __future__ import annotations

import dataclasses
import os
import re
import signal
import subprocess
import threading
import time
from types import FrameType

from tcoll.errors import TcollError
from tcoll.launch.config import LaunchConfig, free_port, new_run_id
from tcoll.launch.coordinator import NodeCoordinator, RemoteFailure, connect_store
from tcoll.launch.hangs import HangWatch, hang_after, remove_job
from tcoll.launch.output import LineForwarder, Sink
from tcoll.launch.process import (
    RankProcess,
    Waker,
    describe_exit,
    exit_code,
    parent_death_hook,
    remove_shm_segments,
    signal_group,
)
from tcoll.startup import keys

__all__ = ["LaunchError", "Runner", "launch"]

# Errors that tell of another rank's failure: a rank that exits with one is not the cause.
_ECHOES = re.compile(r"^(?:[\w.]+\.)?(PeerLostError|PeerFailedError)\b")
_EXCEPTION_LINE = re.compile(r"^(?:[\w.]+\.)?\w+(?:Error|Exception|Interrupt|Exit)\b")
_CAUSE_GRACE = 3.0  # seconds to wait for the cause after a rank exits with an echo

_HANDLED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
_POLL = 0.1  # seconds between checks when no wake-up arrives (e.g. not in the main thread)
_SILENCE_LIMIT = 30.0  # seconds without a heartbeat after which node 0 gives up on a node
_DRAIN_TIMEOUT = 2.0  # seconds to let the ranks' last output through at exit


class LaunchError(TcollError):
    """The launcher could not start or coordinate the job."""


class _Interrupted(BaseException):
    """Raised by the signal handler while the launcher is still setting up (no rank yet)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def launch(config: LaunchConfig, sink: Sink | None = None) -> int:
    """Run the ranks of one node as `config` says and return the launcher's exit code.

    Args:
        config: what to run and where; not modified.
        sink: where output and messages go (default: this process's stdout and stderr).

    Returns:
        0 when every rank exited 0; the failing rank's code (128 + N for signal N);
        128 + N when the launcher received signal N; 2 for a bad configuration;
        1 when the job could not start or lost its store.
    """
    sink = sink or Sink()
    try:
        config.validate()
        if config.command[0] != "-m" and not os.path.isfile(config.command[0]):
            raise ValueError(f"script not found: {config.command[0]}")
    except ValueError as exc:
        sink.message(f"tcoll run: {exc}")
        return 2
    return Runner(config, sink).run()


class Runner:
    """The launcher of one node: owns the store (node 0), the ranks and their cleanup.

    Args:
        config: what to run; copied, since the run id and store port get filled in.
        sink: where output and messages go.
    """

    def __init__(self, config: LaunchConfig, sink: Sink) -> None:
        self.config = dataclasses.replace(config, env=dict(config.env))
        self._sink = sink
        self._waker = Waker()
        self._ranks: list[RankProcess] = []
        self._alive: list[RankProcess] = []
        self._server: object | None = None
        self._coord: NodeCoordinator | None = None
        self._signals: list[int] = []
        self._raise_on_signal = False
        self._old_handlers: dict[int, object] = {}
        self._old_wakeup_fd: int | None = None
        self._hangs: HangWatch | None = None  # the hang report (tcoll.launch.hangs), once the ranks run
        self._report_asked = False  # SIGUSR1 came: report where the ranks are
        self._failures: list[tuple[RankProcess, bool]] = []  # with keep_going: (failed rank, its error an echo)
        self._ran_out = False  # every local rank exited by itself (none was stopped)

    def run(self) -> int:
        """Start the store and the ranks, supervise them, clean up; return the exit code."""
        self._install_handlers()
        try:
            store, torch_port = self._open_store()
            self._raise_on_signal = False  # from now on a signal is forwarded to the ranks
            self._hangs = HangWatch(self.config.run_id, hang_after(self.config.env), self._sink.message,
                                    self._coord, primary=self.config.node_rank == 0)
            self._spawn_all(store, torch_port)
            code = self._supervise()
            if self._ran_out and self._coord is not None:
                code = self._finish_multinode(code)
            return code
        except _Interrupted as exc:
            name = signal.Signals(exc.signum).name
            self._sink.message(f"tcoll run: interrupted by {name} while starting")
            self._abort_others(128 + exc.signum, f"its launcher received {name} while starting")
            return 128 + exc.signum
        except (TcollError, ConnectionError, ValueError, OSError) as exc:
            self._sink.message(f"tcoll run: {exc}")
            self._abort_others(1, f"its launcher failed: {exc}")
            return 1
        finally:
            self._raise_on_signal = False
            self._cleanup()
            self._restore_handlers()
            self._merge_trace()

    def _merge_trace(self) -> None:
        """With TCOLL_TRACE (or --trace), join the ranks' timeline parts into the one file it names."""
        path = self.config.env.get("TCOLL_TRACE") or os.environ.get("TCOLL_TRACE")
        if path:
            from tcoll.p2p.timeline import merge

            try:
                merged = merge(path)
            except (OSError, ValueError) as exc:
                self._sink.message(f"tcoll run: cannot merge the trace {path}: {exc}")
                return
            if merged:
                self._sink.message(f"tcoll run: timeline of {merged} ranks in {path} (open it in ui.perfetto.dev)")

    def _abort_others(self, code: int, reason: str) -> None:
        """Tell the other nodes this one gave up, so they do not wait for it."""
        if self._coord is not None:
            self._coord.abort(-1, code, reason)

    # -- setup -----------------------------------------------------------------------

    def _install_handlers(self) -> None:
        """Catch SIGINT/SIGTERM/SIGHUP (to forward them) and SIGCHLD (to notice exits at once)."""
        if threading.current_thread() is not threading.main_thread():
            return  # signals can only be handled there; the loop then polls
        self._old_wakeup_fd = signal.set_wakeup_fd(self._waker.write_fd, warn_on_full_buffer=False)
        for signum in (*_HANDLED, signal.SIGCHLD, signal.SIGUSR1):
            self._old_handlers[signum] = signal.signal(signum, self._on_signal)
        self._raise_on_signal = True

    def _restore_handlers(self) -> None:
        """Put back the handlers and wake-up fd found at start, then close the self-pipe."""
        for signum, handler in self._old_handlers.items():
            signal.signal(signum, handler)  # type: ignore[arg-type]
        if self._old_wakeup_fd is not None:
            signal.set_wakeup_fd(self._old_wakeup_fd)
        self._waker.close()

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        """Record a signal; before any rank exists, abandon the setup instead."""
        if signum == signal.SIGCHLD:
            return  # the wake-up fd already woke the main loop
        if signum == signal.SIGUSR1:
            self._report_asked = True  # a hang report, and the job goes on
            return
        self._signals.append(signum)
        if self._raise_on_signal:
            self._raise_on_signal = False
            raise _Interrupted(signum)

    def _open_store(self) -> tuple[tuple[str, int], int]:
        """Host the store on node 0; with several nodes join the others through it.

        Returns:
            ((store host, store port), the MASTER_PORT for torch scripts).

        Raises:
            LaunchError, tcoll.RendezvousError: the store cannot be hosted or reached.
            ValueError: this node disagrees with node 0.
        """
        cfg = self.config
        host = cfg.master_addr or "127.0.0.1"
        port = cfg.master_port
        auth_key = self._job_key(f"{host}:{port}")
        if cfg.node_rank == 0:
            from tcoll.store.tcp import TCPStoreServer

            try:
                self._server = server = TCPStoreServer(host, port, auth_key=auth_key)
            except (OSError, TcollError) as exc:
                raise LaunchError(f"cannot host the tcoll store at {host}:{port}: {exc}") from exc
            port = server.port
            cfg.run_id = cfg.run_id or new_run_id()
        cfg.master_addr, cfg.master_port = host, port
        if cfg.nnodes == 1:
            return (host, port), free_port(host, avoid=port)
        self._coord = NodeCoordinator(cfg, self._waker.set,
                                      lambda h, p, t, ct: connect_store(h, p, t, ct, auth_key))
        cfg.run_id = self._coord.join()
        return (host, port), port + 1  # every launcher derives it alike, with no exchange

    def _job_key(self, master: str) -> str | None:
        """The job's key, also handed to every rank: TCOLL_AUTH_KEY, else a new one (see `tcoll.startup.keys`).

        One node makes a random key. Several nodes cannot exchange one before they
        meet, so each derives it from the user's secret and the master address.
        """
        cfg = self.config
        given = cfg.env.get("TCOLL_AUTH_KEY", os.environ.get("TCOLL_AUTH_KEY"))
        if given is not None:
            key = keys.job_key("", master, {"TCOLL_AUTH_KEY": given})
        elif cfg.nnodes == 1:
            key = keys.new_job_key()
        else:
            key = keys.derived_key(keys.user_secret(keys.secret_path()), "tcoll-run", master)
        cfg.env["TCOLL_AUTH_KEY"] = key
        return key or None

    def _spawn_all(self, store: tuple[str, int], torch_port: int) -> None:
        """Start every local rank with its environment and output forwarders.

        Raises:
            LaunchError: a rank could not be started.
        """
        cfg = self.config
        base = dict(os.environ)
        hook = parent_death_hook()
        for local_rank in range(cfg.nprocs):
            rank = cfg.first_rank + local_rank
            env = cfg.rank_env(local_rank, store, torch_port, base)
            try:
                # The hook makes a single prctl call through a ctypes function resolved
                # before the fork: it takes no lock another thread could hold.
                proc = subprocess.Popen(cfg.argv(), env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                        start_new_session=True, preexec_fn=hook)  # noqa: PLW1509
            except OSError as exc:
                raise LaunchError(f"cannot start rank {rank}: {exc}") from exc
            prefix = f"[{rank}] ".encode() if cfg.prefix else b""
            assert proc.stdout is not None and proc.stderr is not None
            entry = RankProcess(rank, proc, LineForwarder(proc.stdout, self._sink, False, prefix),
                                LineForwarder(proc.stderr, self._sink, True, prefix, cfg.tail_lines))
            self._ranks.append(entry)
            self._alive.append(entry)

    # -- supervision -----------------------------------------------------------------

    def _reap(self) -> list[RankProcess]:
        """Forget the ranks that exited (the hang report learns how); return those that failed."""
        failed = []
        for entry in list(self._alive):
            if entry.reap():
                self._alive.remove(entry)
                if self._hangs is not None:
                    self._hangs.exited[entry.rank] = describe_exit(entry.proc.returncode)
                if entry.proc.returncode != 0:
                    failed.append(entry)
        return failed

    def _supervise(self) -> int:
        """Wait until every rank exits, or something stops the job; return the exit code."""
        while True:
            if self._signals:
                return self._on_interrupt(self._signals[0])
            failed = self._reap()
            if failed and not self.config.keep_going:
                return self._on_rank_failure(self._cause(failed[0]))
            for entry in failed:
                self._note_failure(entry)
            if not self._alive:
                self._ran_out = True
                return self._kept_code()
            code = self._check_remote()
            if code is not None:
                return code
            self._watch_hangs()
            self._waker.wait(_POLL)

    def _watch_hangs(self) -> None:
        """Report where the ranks are when asked (SIGUSR1) or when the job made no progress for a while."""
        if self._hangs is not None:
            if self._report_asked:
                self._report_asked = False
                self._hangs.report_now()
            self._hangs.check()

    def _cause(self, first: RankProcess) -> RankProcess:
        """The failed rank to report: the first whose error is a cause, not the echo of another's.

        A rank that saw a peer vanish or fail (PeerLostError, PeerFailedError) often
        exits before the rank whose error started it all: wait a moment for that one.
        """
        if not _is_echo(first):
            return first
        deadline = time.monotonic() + _CAUSE_GRACE
        while self._alive and time.monotonic() < deadline:
            self._waker.wait(_POLL)
            for entry in list(self._alive):
                if entry.reap():
                    self._alive.remove(entry)
                    if entry.proc.returncode != 0 and not _is_echo(entry):
                        return entry
        return first

    def _note_failure(self, failed: RankProcess) -> None:
        """With keep_going: report a failed rank, tell the other nodes, and let the others run on."""
        self._failures.append((failed, _is_echo(failed)))
        line = _failure_line(failed)
        if self._alive:
            others = "the other local rank goes" if len(self._alive) == 1 else \
                f"the other {len(self._alive)} local ranks go"
            line += f"; {others} on (--keep-going)"
        self._sink.message(line)
        if self._coord is not None:
            self._coord.note_failure(failed.rank, exit_code(failed.proc.returncode),
                                     describe_exit(failed.proc.returncode))

    def _kept_code(self) -> int:
        """The exit code once every rank ended: the first failure that is a cause, else the first one, else 0."""
        causes = [entry for entry, echo in self._failures if not echo] or [entry for entry, _ in self._failures]
        return exit_code(causes[0].proc.returncode) if causes else 0

    def _on_rank_failure(self, failed: RankProcess) -> int:
        """Report a failed rank with its last stderr line, stop the others, return its code."""
        returncode = failed.proc.returncode
        reason = describe_exit(returncode)
        lines = [_failure_line(failed)]
        if self._alive:
            lines.append(f"tcoll run: stopping the other {len(self._alive)} local ranks")
        self._sink.message("\n".join(lines))
        if self._coord is not None:
            self._coord.abort(failed.rank, exit_code(returncode), reason)
            self._coord.publish("failed")
        self._stop_all(signal.SIGTERM)
        return exit_code(returncode)

    def _on_interrupt(self, signum: int) -> int:
        """Forward a received signal to every rank, stop them, return 128 + signum."""
        name = signal.Signals(signum).name
        if signum == signal.SIGINT and self._hangs is not None:
            self._hangs.report_now(only_if_stuck=True)  # Ctrl-C on a stuck job: say where it was stuck
        self._sink.message(f"tcoll run: received {name}, stopping {len(self._alive)} local ranks")
        if self._coord is not None:
            self._coord.abort(-1, 128 + signum, f"its launcher received {name}")
            self._coord.publish("interrupted")
        self._stop_all(signum)
        return 128 + signum

    def _check_remote(self) -> int | None:
        """Act on news from the other nodes; return an exit code if the job is over."""
        coord = self._coord
        if coord is None:
            return None
        self._say_remote_failures(coord)
        if coord.failure is not None:
            self._report_remote(coord.failure)
            self._stop_all(signal.SIGTERM)
            return coord.failure.code
        if coord.lost:
            cfg = self.config
            self._sink.message(f"tcoll run: lost the tcoll store at {cfg.master_addr}:{cfg.master_port} "
                               f"({coord.lost}); stopping the ranks of node {cfg.node_rank}")
            self._stop_all(signal.SIGTERM)
            return 1
        return None

    def _say_remote_failures(self, coord: NodeCoordinator) -> None:
        """With keep_going: report the ranks other nodes saw fail since the last look (their nodes go on)."""
        for failure in coord.take_failures():
            self._sink.message(f"tcoll run: rank {failure.rank} on node {failure.node} {failure.reason}; "
                               "the job goes on (--keep-going)")

    def _remote_code(self, coord: NodeCoordinator) -> int:
        """With keep_going: the code of the job's first failed rank on another node, said once more; else 0."""
        first = coord.first_failure()
        if first is None:
            return 0
        self._sink.message(f"tcoll run: the job's first failure was rank {first.rank} on node {first.node}, "
                           f"which {first.reason}")
        return first.code

    def _report_remote(self, failure: RemoteFailure) -> None:
        """Print what another node announced."""
        if failure.rank >= 0:
            what = f"rank {failure.rank} on node {failure.node} failed ({failure.reason})"
        else:
            what = f"node {failure.node} stopped: {failure.reason}"
        self._sink.message(f"tcoll run: {what}; stopping the ranks of node {self.config.node_rank}")

    def _stop_all(self, first: int) -> None:
        """Send `first` to every live rank's group, then SIGKILL what is left after the grace period.

        A further signal to the launcher during the grace period kills at once.
        """
        self._reap()
        for entry in self._alive:
            signal_group(entry.proc.pid, first)
            signal_group(entry.proc.pid, signal.SIGCONT)  # a stopped rank (SIGSTOP) acts on it now, not at SIGKILL
        deadline = time.monotonic() + self.config.stop_timeout
        seen = len(self._signals)
        while self._alive and len(self._signals) == seen:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            self._waker.wait(min(_POLL, remaining))
            self._reap()
        for entry in self._alive:
            signal_group(entry.proc.pid, signal.SIGKILL)
            entry.proc.wait()
        self._alive.clear()

    def _finish_multinode(self, code: int) -> int:
        """Once every local rank ended by itself: tell the others; node 0 keeps the store up until all are done.

        Args:
            code: the local exit code (non-zero only with keep_going, where a local rank failed).

        Returns:
            `code`; else the code of the job's first failure on another node (keep_going), or of
            a failure that stopped the job meanwhile.
        """
        coord = self._coord
        assert coord is not None
        coord.publish("succeeded" if code == 0 else "ended")
        if self.config.node_rank != 0:
            return code or self._remote_code(coord)
        while True:
            pending = coord.pending_nodes()
            if not pending:
                return code or self._remote_code(coord)
            if self._signals:
                return self._on_interrupt(self._signals[0])
            self._say_remote_failures(coord)
            if coord.failure is not None:
                self._report_remote(coord.failure)
                return coord.failure.code
            silent = coord.silent_node(pending, _SILENCE_LIMIT)
            if silent is not None:
                self._sink.message(f"tcoll run: the launcher of node {silent} stopped answering; giving up")
                coord.abort(-1, 1, f"node {silent} stopped answering")
                return 1
            self._watch_hangs()  # the other nodes' ranks may hang after this node's are done
            self._waker.wait(0.5)

    # -- cleanup ---------------------------------------------------------------------

    def _cleanup(self) -> None:
        """Kill and reap every rank, drain their output, close the store, remove shm files."""
        for entry in self._ranks:
            if not entry.reap():
                signal_group(entry.proc.pid, signal.SIGKILL)
                entry.proc.wait()
        deadline = time.monotonic() + _DRAIN_TIMEOUT
        for entry in self._ranks:
            entry.out.join(max(0.0, deadline - time.monotonic()))
            entry.err.join(max(0.0, deadline - time.monotonic()))
        if self._coord is not None:
            self._coord.close()
        if self._server is not None:
            self._server.close()  # type: ignore[attr-defined]
        remove_shm_segments(self.config.run_id)
        if self.config.run_id:
            remove_job(self.config.run_id)  # the ranks' published states (tcoll.p2p.status)


def _failure_line(failed: RankProcess) -> str:
    """"tcoll run: rank 2 (pid 77) was killed by SIGKILL", with the rank's last stderr line."""
    failed.err.join(_DRAIN_TIMEOUT)  # its group is dead: the pipe ends soon
    # Its stderr, traceback included, was forwarded already: name the failure in one line, not twice.
    last = next((line.strip() for line in reversed(failed.err.tail()) if line.strip()), "")
    reason = describe_exit(failed.proc.returncode)
    return f"tcoll run: rank {failed.rank} (pid {failed.proc.pid}) {reason}" + (f": {last}" if last else "")


def _is_echo(entry: RankProcess) -> bool:
    """Whether a failed rank's last exception (in its stderr) only reports another rank's failure."""
    entry.err.join(_DRAIN_TIMEOUT)
    raised = [line for line in entry.err.tail() if _EXCEPTION_LINE.match(line)]
    return bool(raised) and bool(_ECHOES.match(raised[-1]))
