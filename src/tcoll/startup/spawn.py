"""`tcoll.spawn`: run a function on N ranks (processes or threads) and collect the results.

What the seed examples do by hand with `mp.Process` and `init_process_group`,
in one call, for scripts, notebooks and tests: the parent hosts the
rendezvous store, starts the ranks, returns their results in rank order, and
when one rank fails it stops the others and re-raises that failure, naming
the rank.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import secrets
import signal
import sys
import threading
import time
import traceback
import warnings
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection, wait
from typing import Any

from ..errors import SpawnError
from ..segments import remove_shm_segments
from . import keys

__all__ = ["spawn"]

_GRACE = 3.0


def spawn(fn: Callable[..., Any], nprocs: int, args: Sequence[Any] = (), *, threads: bool = False,
          timeout: float | None = None, start_method: str | None = None,
          env: dict[str, str] | None = None, keep_going: bool = False, **init_kwargs: Any) -> list[Any]:
    """Run ``fn(comm, *args)`` on `nprocs` ranks and return their results in rank order.

    Args:
        fn: the function each rank runs; its first argument is the rank's
            Communicator. For processes it must be picklable (defined at module
            level; with cloudpickle installed, notebook functions work too).
        nprocs: the number of ranks.
        args: more arguments for fn (picklable for processes).
        threads: run the ranks as threads of this process (loopback transport).
        timeout: seconds the whole run may take (default: none); also the
            communicators' timeout (else TCOLL_TIMEOUT in the ranks, or 300).
        start_method: multiprocessing start method (default: forkserver where
            available, with numpy and tcoll preloaded, and torch where this process
            has imported it; else spawn).
        env: environment variables to set in each rank process.
        keep_going: when a rank fails (an exception, or its process dies), let the others run to their
            own end instead of stopping them (as `tcoll run --keep-going`): survivors that shrink()
            their communicator go on without it. A failure is still raised once all have ended.
        **init_kwargs: passed to `tcoll.init` in each rank (transport, shm_chunk, ...).

    Returns:
        The ranks' return values (picklable, for processes), in rank order.

    Raises:
        SpawnError: a rank raised, exited early or was killed; its exception
            is chained as __cause__ when it could be pickled back. When one
            rank fails, the PeerLostErrors of the ranks that waited on it are
            not reported in its place. With keep_going, raised after every
            rank ended; its `results` are the ranks' return values (None for
            a failed rank) and its `failures` map each failed rank to what happened.
        tcoll.TimeoutError: the run took longer than `timeout`; every rank is
            stopped first (threads: their communicators are closed).
        TypeError, ValueError: fn does not pickle (processes, no cloudpickle),
            or a bad keyword for tcoll.init; nothing has been started.
    """
    if not isinstance(nprocs, int) or isinstance(nprocs, bool) or nprocs < 1:
        raise ValueError(f"nprocs must be a positive integer, not {nprocs!r}")
    _check_init_kwargs(init_kwargs)
    if timeout is not None:
        init_kwargs["timeout"] = timeout
    if threads:
        return _spawn_threads(fn, nprocs, tuple(args), timeout, init_kwargs, keep_going)
    return _spawn_processes(fn, nprocs, tuple(args), timeout, start_method, env or {}, init_kwargs, keep_going)


def _check_init_kwargs(init_kwargs: dict[str, Any]) -> None:
    """Refuse keywords tcoll.init would refuse in every rank, before any rank starts.

    Raises:
        TypeError: a keyword that is not a `tcoll.env.Settings` field, or one spawn sets itself.
        ValueError: a bad value (e.g. transport="udp").
    """
    import dataclasses

    from ..env import Settings

    fields = {field.name for field in dataclasses.fields(Settings)}
    reserved = sorted(init_kwargs.keys() & {"rank", "size", "store", "init_method", "run_id"})
    if reserved:
        raise TypeError(f"tcoll.spawn chooses {', '.join(reserved)} for its ranks itself")
    unknown = sorted(init_kwargs.keys() - fields)
    if unknown:
        raise TypeError(f"tcoll.spawn got unexpected keyword(s) {', '.join(unknown)}; "
                        f"the keywords it passes to tcoll.init are: {', '.join(sorted(fields))}")
    Settings.from_env({}, **init_kwargs)


# -- threads -------------------------------------------------------------------


def _spawn_threads(fn: Callable[..., Any], nprocs: int, args: tuple[Any, ...], timeout: float | None,
                   init_kwargs: dict[str, Any], keep_going: bool) -> list[Any]:
    from ..store.memory import MemoryStore
    from .init import init

    store = MemoryStore()
    run_id = secrets.token_hex(6)
    results: list[Any] = [None] * nprocs
    errors: dict[int, BaseException] = {}
    comms: list[Any] = []

    def rank_main(rank: int) -> None:
        comm = None
        try:
            comm = init(rank=rank, size=nprocs, store=store, run_id=run_id, **init_kwargs)
            comms.append(comm)
            results[rank] = fn(comm, *args)
        except BaseException as exc:  # noqa: BLE001 - reported to the caller below
            errors[rank] = exc
        finally:
            if comm is not None:  # peers blocked on this rank see it go at once
                late = _close(comm, rank in errors)
                if late is not None:
                    errors[rank] = late

    workers = [threading.Thread(target=rank_main, args=(r,), name=f"tcoll-rank-{r}", daemon=True)
               for r in range(nprocs)]
    for worker in workers:
        worker.start()
    deadline = None if timeout is None else time.monotonic() + timeout
    for worker in workers:
        worker.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
    running = [rank for rank, worker in enumerate(workers) if worker.is_alive()]
    _merge_timeline({})
    if running:
        # Closing a communicator fails the operations its rank is blocked in: the threads end.
        for comm in comms:
            _close(comm, True)
        stop_by = time.monotonic() + _GRACE
        for worker in workers:
            worker.join(max(0.0, stop_by - time.monotonic()))
        from ..errors import TimeoutError

        raise TimeoutError(f"tcoll.spawn(threads=True) did not finish within {timeout} s; ranks "
                           f"{running} still running", running)
    if errors:
        rank = _first_cause(errors)
        error = errors[rank]
        text = "".join(traceback.format_exception(type(error), error, error.__traceback__))
        failure = SpawnError(rank, _describe_error(error), text)
        if keep_going:
            _kept(failure, results, {r: _describe_error(e) for r, e in errors.items()})
        raise failure from error
    return results


def _kept(error: SpawnError, results: list[Any], failures: dict[int, str]) -> SpawnError:
    """Attach what every rank of a keep_going run ended with to the error it raises."""
    error.results = [None if rank in failures else value for rank, value in enumerate(results)]  # type: ignore[attr-defined]
    error.failures = dict(sorted(failures.items()))  # type: ignore[attr-defined]
    return error


def _first_cause(errors: dict[int, BaseException]) -> int:
    """The rank whose failure is the root cause: not a PeerLostError if another error exists."""
    from ..errors import PeerLostError

    primary = [rank for rank, exc in errors.items() if not isinstance(exc, PeerLostError)]
    return min(primary or errors)


def _merge_timeline(env: dict[str, str]) -> None:
    """With TCOLL_TRACE, join the ranks' parts of the timeline into the one file it names (as tcoll run does)."""
    path = env.get("TCOLL_TRACE") or os.environ.get("TCOLL_TRACE")
    if path:
        from ..p2p.timeline import merge

        try:
            merge(path)
        except (OSError, ValueError) as exc:  # the job's results stand; only its picture is lost
            warnings.warn(f"tcoll.spawn: cannot merge the trace {path}: {exc}", RuntimeWarning, stacklevel=3)


# -- processes -----------------------------------------------------------------


def _spawn_processes(fn: Callable[..., Any], nprocs: int, args: tuple[Any, ...], timeout: float | None,
                     start_method: str | None, env: dict[str, str], init_kwargs: dict[str, Any],
                     keep_going: bool) -> list[Any]:
    from ..store.tcp import TCPStoreServer

    payload = _pickle_function(fn)  # first: a TypeError here must leave nothing running
    context = _context(start_method)
    given = env.get("TCOLL_AUTH_KEY", os.environ.get("TCOLL_AUTH_KEY"))
    key = keys.job_key("", "", {"TCOLL_AUTH_KEY": given}) if given is not None else keys.new_job_key()
    server = TCPStoreServer("127.0.0.1", 0, auth_key=key or None)
    run_id = secrets.token_hex(6)
    procs: list[Any] = []
    pipes: list[Connection] = []
    try:
        for rank in range(nprocs):
            rank_env = dict(env, TCOLL_RANK=str(rank), TCOLL_SIZE=str(nprocs), TCOLL_LOCAL_RANK=str(rank),
                            TCOLL_LOCAL_SIZE=str(nprocs), TCOLL_MASTER=f"127.0.0.1:{server.port}",
                            TCOLL_STORE_HOSTED="1", TCOLL_RUN_ID=run_id, TCOLL_AUTH_KEY=key)
            parent_end, child_end = context.Pipe(duplex=False)
            proc = context.Process(target=_process_main, args=(payload, args, rank_env, init_kwargs, child_end),
                                   name=f"tcoll-rank-{rank}", daemon=True)
            proc.start()
            child_end.close()
            procs.append(proc)
            pipes.append(parent_end)
        return _collect(procs, pipes, timeout, keep_going)
    finally:
        _stop(procs)
        for pipe in pipes:
            pipe.close()
        server.close()
        remove_shm_segments(run_id)
        _merge_timeline(env)


def _context(start_method: str | None) -> Any:
    if start_method is None:
        start_method = "forkserver" if "forkserver" in mp.get_all_start_methods() else "spawn"
    context = mp.get_context(start_method)
    if start_method == "forkserver":
        # torch too where this process uses it: its ranks then fork with it imported instead of each importing
        # it (a second or more per rank). The server only imports it (no CUDA), so ranks may still use CUDA.
        context.set_forkserver_preload(["numpy", "tcoll"] + (["torch"] if "torch" in sys.modules else []))
    return context


def _pickle_function(fn: Callable[..., Any]) -> bytes:
    """Pickle fn by reference; fall back to cloudpickle (notebooks, lambdas) when installed."""
    try:
        return pickle.dumps(fn)
    except (pickle.PicklingError, AttributeError, TypeError):
        try:
            import cloudpickle  # type: ignore[import-not-found,import-untyped,unused-ignore]
        except ImportError:
            raise TypeError(f"tcoll.spawn needs a picklable function (defined at module level); "
                            f"{fn!r} is not (install cloudpickle to send notebook functions)") from None
        return cloudpickle.dumps(fn)


def _close(comm: Any, failed: bool) -> BaseException | None:
    """Close a rank's communicator; what close raised (a disagreement it learnt of only then) if the rank's
    own run had not already failed, else None: that failure is the one to report."""
    if failed:
        comm.close(linger=False)  # (nor wait for the peers: this rank's own failure is the news)
        return None
    from ..errors import TcollError

    try:
        comm.close()
    except TcollError as exc:
        return exc
    return None


def _process_main(payload: bytes, args: tuple[Any, ...], env: dict[str, str], init_kwargs: dict[str, Any],
                  pipe: Connection) -> None:
    """The body of a rank process: init, run fn, report the result or the error."""
    os.environ.update(env)
    from .init import init

    comm = None
    try:
        fn = pickle.loads(payload)
        comm = init(**init_kwargs)
        status, value, text = "ok", fn(comm, *args), ""
    except BaseException as exc:  # noqa: BLE001 - sent to the parent
        status, value, text = "error", exc, traceback.format_exc()
    if comm is not None:
        late = _close(comm, status == "error")
        if late is not None:
            status, value, text = "error", late, "".join(traceback.format_exception(late))
    # The value travels pickled on its own, so that the parent still gets the
    # status and the traceback text when the value does not survive the trip.
    try:
        blob = pickle.dumps(value)
    except Exception as exc:  # noqa: BLE001 - the result or the error does not pickle
        what = "result" if status == "ok" else "exception"
        status, blob, text = "error", pickle.dumps(None), f"(could not send the {what} back: {exc!r})\n{text}"
    pipe.send((status, blob, text))
    pipe.close()


def _collect(procs: list[Any], pipes: list[Connection], timeout: float | None, keep_going: bool = False) -> list[Any]:
    """Wait for every rank's reply; on the first failure raise it (the caller stops the rest).

    With keep_going, every rank's reply is awaited, and the first cause is raised after the last one.

    A rank that dies without replying (killed, os._exit) is a failure as soon as
    either its pipe closes or its sentinel fires, whichever is seen first. A
    PeerLostError is usually the echo of another rank's failure, which may reach
    us a moment later: it is held back for up to _GRACE seconds while the other
    ranks report, and raised only if no other failure shows up.
    """
    from ..errors import PeerLostError

    results: list[Any] = [None] * len(procs)
    failed: dict[int, tuple[BaseException | None, str, str]] = {}  # keep_going: rank -> (error, traceback, how)
    pending = set(range(len(procs)))
    owner: dict[Any, int] = {}
    for rank, (proc, pipe) in enumerate(zip(procs, pipes)):
        owner[pipe] = owner[proc.sentinel] = rank
    deadline = None if timeout is None else time.monotonic() + timeout
    echo: tuple[int, BaseException | None, str] | None = None  # a held-back PeerLostError failure
    echo_until = 0.0
    while pending:
        limits = [t for t in (deadline, echo_until if echo is not None else None) if t is not None]
        left = None if not limits else max(0.0, min(limits) - time.monotonic())
        ready = wait([pipes[r] for r in pending] + [procs[r].sentinel for r in pending], left)
        if not ready:
            if echo is not None:
                _raise_failure(*echo)
            from ..errors import TimeoutError

            raise TimeoutError(f"tcoll.spawn did not finish within {timeout} s; ranks "
                               f"{sorted(pending)} still running", pending)
        for obj in ready:
            rank = owner[obj]
            if rank not in pending:
                continue  # its pipe and its sentinel were both ready
            reply = _reply(procs[rank], pipes[rank], obj is pipes[rank])
            if reply is None:
                continue  # the process has exited but its pipe is not closed yet: it will be
            pending.discard(rank)
            status, value, text = reply
            if status == "ok":
                results[rank] = value
            elif keep_going:
                failed[rank] = (value, text if status == "error" else "", text)
            elif status == "died":
                raise SpawnError(rank, text)
            elif isinstance(value, PeerLostError):
                if echo is None:
                    echo, echo_until = (rank, value, text), time.monotonic() + _GRACE
            else:
                _raise_failure(rank, value, text)
    if echo is not None:
        _raise_failure(*echo)
    if failed:
        _raise_kept(failed, results)
    return results


def _raise_kept(failed: dict[int, tuple[BaseException | None, str, str]], results: list[Any]) -> None:
    """Raise the first cause among the failures of a keep_going run, with every rank's outcome attached."""
    from ..errors import PeerLostError

    causes = [r for r, (value, _, _) in failed.items() if not isinstance(value, PeerLostError)]
    rank = min(causes or failed)
    value, text, how = failed[rank]
    said = {r: (_describe_error(v) if v is not None else (h.strip().splitlines() or ["failed"])[-1])
            for r, (v, _, h) in failed.items()}
    error = _kept(SpawnError(rank, said[rank], text), results, said)
    if value is not None:
        raise error from value
    raise error


def _reply(proc: Any, pipe: Connection, pipe_ready: bool) -> tuple[str, Any, str] | None:
    """The rank's reply; ("died", None, how) if it exited without one; None if not known yet."""
    if pipe_ready or pipe.poll():
        try:
            status, blob, text = pipe.recv()
        except EOFError:
            pass  # the process is gone (its end of the pipe closed with it)
        else:
            try:
                return status, pickle.loads(blob), text
            except Exception as exc:  # noqa: BLE001 - e.g. an exception class whose __init__ takes other arguments
                what = "result" if status == "ok" else "exception"
                return "error", None, f"(could not unpickle the {what} it sent back: {exc!r})\n{text}"
    elif proc.is_alive():
        return None
    proc.join()
    return "died", None, _describe_exit(proc.exitcode)


def _raise_failure(rank: int, exc: BaseException | None, text: str) -> None:
    name = type(exc).__name__ if exc is not None else "error"
    last = text.strip().splitlines()[-1] if text.strip() else name
    error = SpawnError(rank, last if exc is None else _describe_error(exc), text)
    if exc is not None:
        raise error from exc
    raise error


def _describe_error(exc: BaseException) -> str:
    if isinstance(exc, SystemExit):
        code = int(exc.code) if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        return f"exited with code {code} (it called sys.exit({exc.code!r}))"
    return f"{type(exc).__name__}: {exc}"


def _describe_exit(code: int | None) -> str:
    if code is not None and code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with code {code} before returning a result"


def _stop(procs: list[Any]) -> None:
    """Terminate ranks still running (SIGTERM, then SIGKILL after a grace period) and reap all."""
    for proc in procs:
        if proc.is_alive():
            proc.terminate()
    stop_by = time.monotonic() + _GRACE  # one grace period for all, not one per rank
    for proc in procs:
        proc.join(max(0.0, stop_by - time.monotonic()))
    for proc in procs:
        if proc.is_alive():
            proc.kill()
        proc.join()
