"""The ``tcoll`` command line: argparse only; each command builds a config and calls the library.

Commands live in the `COMMANDS` registry, ``name -> (add_arguments, handler)``:
``add_arguments(parser)`` fills the command's subparser and ``handler(args)``
returns the exit code; the first line of the handler's docstring is the help.
Only the chosen command's ``add_arguments`` runs, so ``tcoll run`` never
imports what ``tcoll bench`` needs.

``tcoll bench`` is provided by the module ``tcoll.bench.cli``, which must define
``add_arguments(parser: argparse.ArgumentParser) -> None`` and
``main(args: argparse.Namespace) -> int``.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable, Sequence
from types import ModuleType

from tcoll.launch.config import LaunchConfig, parse_master

__all__ = ["COMMANDS", "build_parser", "main", "register_command"]

AddArguments = Callable[[argparse.ArgumentParser], None]
Handler = Callable[[argparse.Namespace], int]

COMMANDS: dict[str, tuple[AddArguments, Handler]] = {}


def register_command(name: str, add_arguments: AddArguments, handler: Handler) -> None:
    """Add (or replace) a ``tcoll <name>`` command.

    Args:
        name: the command word.
        add_arguments: fills the command's argparse subparser.
        handler: runs the command from the parsed arguments and returns the exit code;
            the first line of its docstring is the command's help.
    """
    COMMANDS[name] = (add_arguments, handler)


# -- tcoll run ----------------------------------------------------------------------------


def _master(text: str) -> tuple[str, int]:
    """argparse type for ``ADDR:PORT``."""
    try:
        return parse_master(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _env_pair(text: str) -> tuple[str, str]:
    """argparse type for ``KEY=VALUE``."""
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    return key, value


def _add_run_arguments(parser: argparse.ArgumentParser) -> None:
    """Fill the ``tcoll run`` subparser."""
    parser.usage = ("tcoll run [-n N] [--nnodes M --node-rank R --master ADDR:PORT] [--run-id ID] "
                    "[--no-prefix] [--keep-going] [options] (-m module | script.py) [args ...]")
    parser.add_argument("-n", "--nprocs", "--nproc-per-node", type=int, default=1, metavar="N",
                        help="ranks to start on this node (default: 1)")
    parser.add_argument("--nnodes", type=int, default=1, metavar="M",
                        help="nodes in the job, each running its own `tcoll run` (default: 1)")
    parser.add_argument("--node-rank", type=int, default=0, metavar="R",
                        help="this node's index in 0..M-1; node 0 hosts the store (default: 0)")
    parser.add_argument("--master", type=_master, metavar="ADDR:PORT",
                        help="where node 0 hosts the tcoll store (required with --nnodes > 1; "
                             "torch scripts get MASTER_PORT=PORT+1); default on one node: "
                             "127.0.0.1 and a free port")
    parser.add_argument("--run-id", default="", metavar="ID",
                        help="job id, [A-Za-z0-9_.]; names shared-memory segments (default: random)")
    parser.add_argument("--no-prefix", dest="prefix", action="store_false",
                        help="do not prefix each output line with '[rank] '")
    parser.add_argument("--trace", metavar="FILE.json",
                        help="write a timeline of the job (Perfetto / chrome://tracing JSON), as TCOLL_TRACE=FILE")
    parser.add_argument("--env", type=_env_pair, action="append", default=[], metavar="KEY=VALUE",
                        help="set a variable in every rank (repeatable)")
    parser.add_argument("--grace", type=float, default=3.0, metavar="SECONDS",
                        help="time between SIGTERM and SIGKILL when stopping ranks (default: 3)")
    parser.add_argument("--keep-going", action="store_true",
                        help="when a rank dies, report it and let the others run on (default: stop them all); "
                             "the exit code is still the first failure's")
    parser.add_argument("--join-timeout", type=float, default=300.0, metavar="SECONDS",
                        help="time to wait for the store and the other nodes (default: 300)")
    parser.add_argument("-m", dest="module", nargs=argparse.REMAINDER, metavar="module",
                        help="run a module (like python -m); everything after it goes to the module")
    parser.add_argument("command", nargs=argparse.REMAINDER, metavar="script.py [args ...]",
                        help="the script and its arguments, passed through untouched")
    parser.set_defaults(_parser=parser)


def _run(args: argparse.Namespace) -> int:
    """Start N ranks of a Python script or module on this node (like mpirun or torchrun)."""
    if args.module is not None:
        if not args.module:
            args._parser.error("-m needs a module name")
        command = ["-m", *args.module]
    else:
        command = list(args.command)
        if command[:1] == ["--"]:
            command = command[1:]
    if not command:
        args._parser.error("no script or module to run")
    if args.trace:
        import os

        args.env.append(("TCOLL_TRACE", os.path.abspath(args.trace)))
    host, port = args.master or ("", 0)
    config = LaunchConfig(command=command, nprocs=args.nprocs, nnodes=args.nnodes,
                          node_rank=args.node_rank, master_addr=host, master_port=port,
                          run_id=args.run_id, env=dict(args.env), prefix=args.prefix,
                          stop_timeout=args.grace, join_timeout=args.join_timeout,
                          keep_going=args.keep_going)
    from tcoll.launch.runner import launch  # only `run` pays for importing the runner

    return launch(config)


# -- tcoll bench --------------------------------------------------------------------------

_BENCH_MODULE = "tcoll.bench.cli"


def _bench_module() -> tuple[ModuleType | None, str]:
    """Import the bench command's module.

    Returns:
        (the module, "") or (None, why it could not be imported).
    """
    try:
        return importlib.import_module(_BENCH_MODULE), ""
    except ImportError as exc:
        return None, f"{type(exc).__name__}: {exc}"


def _add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    """Fill the ``tcoll bench`` subparser from `tcoll.bench.cli`, or accept anything if it is missing."""
    module, _ = _bench_module()
    if module is None:
        parser.add_argument("rest", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    else:
        module.add_arguments(parser)


def _bench(args: argparse.Namespace) -> int:
    """Measure collectives: time, algbw, busbw, side by side with gloo and MPI."""
    module, why = _bench_module()
    if module is None:
        print(f"tcoll bench: not available in this installation ({_BENCH_MODULE} cannot be imported: {why})",
              file=sys.stderr)
        return 2
    return int(module.main(args))


# -- tcoll explain | trace ------------------------------------------------------------------


def _size(text: str) -> int:
    """argparse type for a byte count: 8, 64MiB, 1G."""
    from tcoll.env import parse_size

    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _add_call_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments that name a collective call: what, how big, how many ranks."""
    from tcoll.algos.registry import COLLECTIVES

    parser.add_argument("collective", choices=COLLECTIVES, metavar="collective",
                        help=f"one of {', '.join(COLLECTIVES)}")
    parser.add_argument("-n", "--nranks", type=int, default=4, metavar="N", help="ranks (default: 4)")


def _add_explain_arguments(parser: argparse.ArgumentParser) -> None:
    """Fill the ``tcoll explain`` subparser."""
    _add_call_arguments(parser)
    parser.add_argument("size", type=_size, metavar="SIZE",
                        help="bytes of one rank's input: 8, 4096, 256K, 64MiB, 1G")
    parser.add_argument("--transport", choices=("shm", "tcp", "loopback"), default="shm",
                        help="whose link costs to use (default: shm)")
    parser.add_argument("--hosts", type=int, default=1, metavar="H",
                        help="hosts the ranks span; above 1 they talk over tcp (default: 1)")
    parser.add_argument("--async", dest="blocking", action="store_false",
                        help="an async_op=True call: the shared-memory direct algorithms do not run")
    parser.add_argument("--ordered", action="store_true", help="the op is not commutative (keep rank order)")
    parser.add_argument("--gpu", choices=("nccl", "staging"),
                        help="CUDA buffers on this path (docs/gpu.md): say what runs on the GPU first")


def _explain(args: argparse.Namespace) -> int:
    """Show every algorithm's predicted time, messages and bytes for one call, and the choice (runs nothing)."""
    from tcoll.algos.select import explain

    if args.nranks < 1 or args.hosts < 1:
        print("tcoll explain: -n and --hosts must be at least 1", file=sys.stderr)
        return 2
    print(explain(args.collective, args.size, args.nranks, args.transport, ordered=args.ordered,
                  blocking=args.blocking, hosts=args.hosts, gpu=args.gpu))
    return 0


def _add_trace_arguments(parser: argparse.ArgumentParser) -> None:
    """Fill the ``tcoll trace`` subparser."""
    _add_call_arguments(parser)
    parser.add_argument("--algorithm", default="auto",
                        help="an algorithm, shm included (default: the cost model's choice over shm)")
    parser.add_argument("--size", type=_size, default=16, metavar="SIZE",
                        help="bytes of one rank's input, float32 elements (default: 16)")
    parser.add_argument("--root", type=int, default=0, help="root of rooted collectives (default: 0)")
    parser.add_argument("--chunk", type=_size, default=0, metavar="BYTES",
                        help="bytes per message of pipelined algorithms, or TCOLL_SHM_SLOT for shm ones "
                             "(default: no cutting, 1 MiB slots)")
    parser.add_argument("--steps", action="store_true", help="one panel per step, ranks on a circle")
    parser.add_argument("-o", "--output", required=True, metavar="FILE", help="the picture: .png or .svg")


def _trace(args: argparse.Namespace) -> int:
    """Draw an algorithm's schedule: who sends which block to whom at each step (needs matplotlib)."""
    from tcoll.algos.record import record
    from tcoll.algos.registry import lookup
    from tcoll.algos.select import COSTS, choose
    from tcoll.shm.record import record_direct

    name = args.algorithm
    if name == "auto":
        name = choose(args.collective, args.size, args.nranks, COSTS["shm"]).name
    try:
        from tcoll.trace.draw import draw, draw_steps, save

        direct = lookup(args.collective, name).direct
        options = {("slot_bytes" if direct else "chunk_bytes"): args.chunk} if args.chunk else {}
        schedule = (record_direct if direct else record)(args.collective, name, args.nranks, max(1, args.size // 4),
                                                         root=args.root, **options)
        save((draw_steps if args.steps else draw)(schedule), args.output)
    except (ImportError, ValueError, RuntimeError) as exc:
        print(f"tcoll trace: {exc}", file=sys.stderr)
        return 2
    moved = f"{len(schedule.accesses)} slot copies" if direct else f"{len(schedule.messages)} messages"
    print(f"{args.output}: {schedule.collective} {schedule.algorithm} on {schedule.size} ranks, "
          f"{moved} in {schedule.steps} step{'s' if schedule.steps != 1 else ''}")
    return 0


def _add_status_arguments(parser: argparse.ArgumentParser) -> None:
    """Fill the ``tcoll status`` subparser."""
    parser.add_argument("--job", default="", metavar="ID", help="only this job (its run id; default: every job "
                                                                "of this user running on this host)")


def _status(args: argparse.Namespace) -> int:
    """Show where the ranks of this user's running tcoll jobs are: a row per rank and a verdict (a hang report)."""
    from tcoll.launch.hangs import ask_dump, job_states, report, running_jobs

    jobs = running_jobs()
    if args.job:
        jobs = {args.job: jobs[args.job]} if args.job in jobs else {}
    if not jobs:
        print(f"tcoll status: no running tcoll job{' ' + args.job if args.job else ''} of this user on this host "
              "(ranks publish their state unless TCOLL_STATUS=off)", file=sys.stderr)
        return 1
    print("\n\n".join(report(job, job_states(job, directory)) for job, directory in jobs.items()))
    for job, directory in jobs.items():
        ask_dump(job, directory)  # ranks with TCOLL_DUMP write their flight-recorder dumps
    return 0


register_command("run", _add_run_arguments, _run)
register_command("bench", _add_bench_arguments, _bench)
register_command("explain", _add_explain_arguments, _explain)
register_command("trace", _add_trace_arguments, _trace)
register_command("status", _add_status_arguments, _status)


# -- entry point ----------------------------------------------------------------------------


def _summary(handler: Handler) -> str:
    """The first line of a handler's docstring."""
    lines = (handler.__doc__ or "").strip().splitlines()
    return lines[0] if lines else ""


def build_parser(chosen: str | None = None) -> argparse.ArgumentParser:
    """Build the ``tcoll`` parser.

    Args:
        chosen: the command about to run; only its arguments are added (all when None).

    Returns:
        The parser; parsed arguments carry ``handler``.
    """
    from tcoll import __version__

    parser = argparse.ArgumentParser(prog="tcoll", description="Collective communication for Python.")
    parser.add_argument("--version", action="version", version=f"tcoll {__version__}")
    subparsers = parser.add_subparsers(dest="command_name", metavar="command")
    for name, (add_arguments, handler) in COMMANDS.items():
        summary = _summary(handler)
        sub = subparsers.add_parser(name, help=summary, description=summary)
        if chosen is None or chosen == name:
            add_arguments(sub)
        sub.set_defaults(handler=handler)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``tcoll`` command line.

    Args:
        argv: the arguments after the program name (default: ``sys.argv[1:]``).

    Returns:
        The exit code (2 for a usage error).
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    chosen = next((arg for arg in argv if not arg.startswith("-")), None)
    parser = build_parser(chosen)
    try:
        args = parser.parse_args(argv)
        if getattr(args, "handler", None) is None:
            parser.print_usage(sys.stderr)
            return 2
        return args.handler(args)
    except SystemExit as exc:  # argparse's usage errors and --help
        return exc.code if isinstance(exc.code, int) else 1
