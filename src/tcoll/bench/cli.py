"""`tcoll bench`: the benchmark commands (argparse only; the work is in the bench modules).

    tcoll bench p2p [-b 8] [-e 256M] [-f 4] [--transports shm,tcp]
    tcoll bench all_reduce -n 4 -b 8 -e 256M -f 4 [-d float32] [-o sum] [--check]
        [--algorithm NAME|all] [--buffers plain|shm|both] [--compare gloo,mpi,tcoll-mpi,deepspeed] [--load K]
        [--persistent] [--no-floor] [--no-copy] [--repeats 3] [--iters N] [--warmup N] [--json F]
        [--plot F.png] [--markdown]
    tcoll bench all_reduce --device cuda [--compare nccl] ...   (CUDA tensors; plain buffers, no floor or copy)
"""

from __future__ import annotations

import argparse
import json
import math
import signal
import sys
from typing import Any

from ..env import parse_size
from . import BenchError
from .collectives import CASES, DTYPES, OPS
from .device import cuda_problem, describe_cuda, gpu_count
from .load import LoadGenerator
from .machine import describe_machine
from .p2p import P2PRow, run_p2p, sizes_between
from .plan import BenchConfig
from .report import (
    PlotUnavailable,
    Progress,
    aggregate,
    check_plot,
    format_tables,
    plot,
    write_json,
)
from .runner import run_bench

__all__ = ["add_arguments", "main"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Fill the `tcoll bench` subparser."""
    parser.add_argument("case", metavar="case",
                        help="p2p (ping-pong latency and bandwidth), a collective (" + ", ".join(CASES) +
                             "), several separated by commas, or 'all'")
    parser.add_argument("-b", "--minbytes", default="8", help="smallest size (default 8)")
    parser.add_argument("-e", "--maxbytes", default="256M", help="largest size (default 256M)")
    parser.add_argument("-f", "--stepfactor", type=int, default=4, help="size multiplier between rows (default 4)")
    parser.add_argument("--repeats", type=int, default=3, help="repetitions; medians reported (default 3)")
    parser.add_argument("--json", metavar="FILE", help="also write every sample as JSON")
    parser.add_argument("--markdown", action="store_true", help="print the table as Markdown")
    group = parser.add_argument_group("collectives")
    group.add_argument("-n", "--nranks", type=int, default=2, help="ranks (default 2)")
    group.add_argument("-d", "--dtype", default="float32", choices=DTYPES, help="element type (default float32)")
    group.add_argument("-o", "--op", default="sum", choices=OPS, help="reduction op (default sum)")
    group.add_argument("-r", "--root", type=int, default=0, help="root of rooted collectives (default 0)")
    group.add_argument("--algorithm", default="auto",
                       help="tcoll algorithm: auto (default), a name of tcoll.algorithms(case), or all")
    group.add_argument("--buffers", default="plain", choices=["plain", "shm", "both"],
                       help="tcoll buffers: plain NumPy arrays, comm.empty shared memory, or both (default plain)")
    group.add_argument("--check", action="store_true", help="count wrong result elements (#wrong) per size")
    group.add_argument("--iters", type=int, help="timed calls per size (default: adaptive, 5..1000)")
    group.add_argument("--warmup", type=int,
                       help="warm-up calls per size, at least 1 (the first shows whether a call can run; "
                            "default: adaptive, 2..20)")
    group.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                       help="where every rank's buffers live: cpu (default), or cuda: torch CUDA tensors on GPU "
                            "local rank %% GPU count (ranks may share one; TCOLL_GPU chooses tcoll's path), each "
                            "batch of calls timed to torch.cuda.synchronize()")
    group.add_argument("--compare", default="", metavar="gloo,mpi,tcoll-mpi,deepspeed,nccl",
                       help="also measure torch.distributed gloo, mpi4py (MPICH), tcoll over its MPI engine, "
                            "and/or DeepSpeed's CPU shared-memory all_reduce (float sums only); with --device "
                            "cuda: nccl (torch.distributed's NCCL, a GPU per rank)")
    group.add_argument("--mpiexec", metavar="PATH",
                       help="the mpiexec of mpi4py's MPI library, for --compare mpi,tcoll-mpi (default: the one "
                            "beside this Python, else on PATH); a job whose ranks see another size is refused")
    group.add_argument("--load", type=int, default=0, metavar="K",
                       help="run K busy processes during the whole measurement")
    group.add_argument("--plot", metavar="FILE.png", help="plot busbw and time vs size (needs matplotlib)")
    group.add_argument("--persistent", action="store_true",
                       help="also time tcoll's persistent form (a plan from comm.<case>_init, run per call)")
    group.add_argument("--no-floor", dest="floor", action="store_false",
                       help="all_reduce: skip the floor column (bare Python over shared-memory flags, same run)")
    group.add_argument("--no-copy", dest="copy", action="store_false",
                       help="all_reduce: skip the copy columns (each rank's np.copyto rate at the row's size, "
                            "all ranks at once, same run; busbw as a fraction of it)")
    group.add_argument("--timeout", type=float, default=1800.0,
                       help="seconds one implementation's sweep may take (default 1800)")
    group = parser.add_argument_group("p2p")
    group.add_argument("--transports", default="shm,tcp", help="comma-separated (default shm,tcp)")
    group.add_argument("--no-raw-tcp", dest="raw_tcp", action="store_false",
                       help="skip the plain TCP loopback socket reference")


def main(args: argparse.Namespace) -> int:
    """Run a benchmark and print its table."""
    if args.case == "p2p":
        return _main_p2p(args)
    try:
        config = _config(args)
    except UsageError as exc:
        print(f"tcoll bench: {exc}", file=sys.stderr)
        return 2
    return _main_collectives(args, config)


class UsageError(ValueError):
    """A bad combination of options (exit code 2)."""


def _cases(text: str) -> list[str]:
    names = list(CASES) if text == "all" else [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in CASES]
    if unknown or not names:
        raise UsageError(f"unknown case {', '.join(unknown) or text!r}; choose p2p, all, or from "
                         f"{', '.join(CASES)}")
    return names


def _targets(text: str, cases: list[str], dtype: str, op: str) -> list[str]:
    """The compare targets asked for that can run here and run some case; the others are noted on stderr."""
    from .compare import TARGETS, limits, missing

    targets = []
    for name in dict.fromkeys(t.strip() for t in text.split(",") if t.strip()):
        if name not in TARGETS:
            raise UsageError(f"unknown compare target {name!r}; choose from {', '.join(TARGETS)}")
        why = missing(name)
        if why is None:
            kept, note = limits(name, cases, dtype, op)
            if note:
                print(f"# compare: {name}: {note}" if kept else f"# compare: {name} skipped: {note}", file=sys.stderr)
            if not kept:
                continue
            targets.append(name)
        else:
            print(f"# compare: {name} skipped: {why}", file=sys.stderr)
    return targets


def _config(args: argparse.Namespace) -> BenchConfig:
    """The run's configuration from the arguments, every check made before anything starts."""
    from .. import Communicator, algorithms

    cases = _cases(args.case)
    if args.nranks < 1 or not 0 <= args.root < args.nranks:
        raise UsageError(f"need -n >= 1 and 0 <= root < n (got -n {args.nranks}, root {args.root})")
    if args.repeats < 1 or (args.iters is not None and args.iters < 1) or args.load < 0:
        raise UsageError("--repeats and --iters must be at least 1, --load at least 0")
    if args.algorithm not in ("auto", "all"):
        for case in cases:
            if args.algorithm not in algorithms(case):
                raise UsageError(f"{case} has no algorithm {args.algorithm!r}; choose auto, all, or one of "
                                 f"{', '.join(algorithms(case))}")
    buffers = ["plain", "shm"] if args.buffers == "both" else [args.buffers]
    if "shm" in buffers and not hasattr(Communicator, "empty"):
        raise UsageError("--buffers shm needs Communicator.empty (shared-memory arrays), which this tcoll does "
                         "not have; use --buffers plain")
    if args.plot:
        try:
            check_plot()
        except PlotUnavailable as exc:
            raise UsageError(str(exc)) from None
    try:
        sizes = sizes_between(parse_size(args.minbytes), parse_size(args.maxbytes), args.stepfactor)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    _check_device(args)
    compare = _targets(args.compare, cases, args.dtype, args.op)
    if "nccl" in compare and args.nranks > gpu_count():  # NCCL refuses two ranks on one GPU
        print(f"# compare: nccl skipped: {args.nranks} ranks share {gpu_count()} GPU(s); NCCL needs one GPU per "
              "rank", file=sys.stderr)
        compare.remove("nccl")
    cpu = args.device == "cpu"
    return BenchConfig(cases=cases, n=args.nranks, sizes=sizes, dtype=args.dtype, op=args.op, root=args.root,
                       algorithm=args.algorithm, buffers=buffers, compare=compare,
                       repeats=args.repeats, iters=args.iters, warmup=args.warmup, check=args.check,
                       timeout=args.timeout, persistent=args.persistent, floor=args.floor and cpu,
                       copy=args.copy and cpu, mpiexec=args.mpiexec, device=args.device)


_CPU_TARGETS = ("gloo", "mpi", "tcoll-mpi", "deepspeed")


def _check_device(args: argparse.Namespace) -> None:
    """Refuse what --device does not go with; --device cuda without a CUDA device fails here, before any rank."""
    targets = {t.strip() for t in args.compare.split(",") if t.strip()}
    if args.device == "cpu":
        if "nccl" in targets:
            raise UsageError("--compare nccl needs --device cuda (NCCL moves CUDA tensors)")
        return
    if args.buffers != "plain":
        raise UsageError(f"--buffers {args.buffers} is for --device cpu (comm.empty is host shared memory); "
                         "--device cuda times plain CUDA tensors")
    if args.persistent:
        raise UsageError("--persistent is for --device cpu (tcoll's persistent plans take CPU buffers only)")
    cpu_only = sorted(targets & set(_CPU_TARGETS))
    if cpu_only:
        raise UsageError(f"--compare {','.join(cpu_only)} times CPU buffers; with --device cuda compare nccl only")
    why = cuda_problem()
    if why is not None:
        raise UsageError(why)


def _header(config: BenchConfig, load: int) -> dict[str, Any]:
    from .compare import versions

    timing = (f"{config.iters} timed calls" if config.iters else "adaptive timed calls (5..1000)") + \
        f", median of {config.repeats} repeats (min in --json), time = max over ranks"
    if config.device == "cuda":
        timing += ", each batch of calls ended by torch.cuda.synchronize()"
    return {"machine": describe_machine(), "versions": versions(config.compare), "n": config.n,
            "dtype": config.dtype, "op": config.op, "root": config.root, "buffers": ",".join(config.buffers),
            "algorithm": config.algorithm, "load": load, "check": config.check, "timing": timing,
            "device": config.device, "gpus": describe_cuda() if config.device == "cuda" else None,
            "argv": sys.argv[1:]}


def _print_header(header: dict[str, Any]) -> None:
    versions = ", ".join(f"{name} {version}" for name, version in header["versions"].items())
    load = f"{header['load']} busy processes" if header["load"] else "none added"
    lines = [f"machine: {header['machine']}", f"versions: {versions}",
             (f"ranks: {header['n']}, dtype {header['dtype']}, op {header['op']}, root {header['root']}, "
              f"tcoll buffers {header['buffers']}, tcoll algorithm {header['algorithm']}"),
             f"load: {load}", f"timing: {header['timing']}"]
    if header["device"] == "cuda":
        lines[2:2] = [f"device: cuda, {header['gpus']}",
                      ("buffers: torch CUDA tensors on GPU local rank % GPU count; no floor or copy columns "
                       "(host-memory measures, as --no-floor --no-copy)")]
    print("\n".join("# " + line for line in lines), file=sys.stderr)


def _sigterm(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)  # unwinds: the load and the ranks are stopped on the way out


def _main_collectives(args: argparse.Namespace, config: BenchConfig) -> int:
    header = _header(config, args.load)
    _print_header(header)
    previous = signal.signal(signal.SIGTERM, _sigterm)
    try:
        with LoadGenerator(args.load):
            outcome = run_bench(config, Progress())
    except BenchError as exc:
        print(f"tcoll bench: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("tcoll bench: interrupted (ranks and load stopped)", file=sys.stderr)
        return 130
    finally:
        signal.signal(signal.SIGTERM, previous)
    header["info"] = outcome["info"]
    for impl, info in outcome["info"].items():
        details = ", ".join(f"{key} {', '.join(v) if isinstance(v, list) else v}" for key, v in info.items())
        print(f"# {impl}: {details}", file=sys.stderr)
    results = aggregate(outcome["samples"])
    print(format_tables(results, markdown=args.markdown))
    if args.json:
        write_json(args.json, header, results, outcome["samples"])
    if args.plot:
        plot(results, args.plot)
    errors = {(r.impl, r.variant if r.impl == "tcoll" else "", r.case, r.error) for r in results if r.error}
    for impl, variant, case, error in sorted(errors):
        print(f"# {impl} {variant + ' ' if variant else ''}cannot run {case} ('-' in the table): {error}",
              file=sys.stderr)
    failed = 0
    for r in results:
        if r.wrong:
            print(f"# WRONG: {r.impl} {r.variant if r.impl == 'tcoll' else ''} {r.case} at {r.nbytes} B: "
                  f"{r.wrong} wrong elements", file=sys.stderr)
            failed += r.impl == "tcoll"
    return 1 if failed else 0


def _main_p2p(args: argparse.Namespace) -> int:
    sizes = sizes_between(parse_size(args.minbytes), parse_size(args.maxbytes), args.stepfactor)
    transports = [name.strip() for name in args.transports.split(",") if name.strip()]
    print(f"# machine: {describe_machine()}", file=sys.stderr)
    rows = run_p2p(transports, sizes, args.repeats, args.raw_tcp)
    print(format_p2p(rows, transports, markdown=args.markdown))
    print(f"# load after: {describe_machine().rpartition('load average ')[2]}", file=sys.stderr)
    if args.json:
        with open(args.json, "w") as handle:
            json.dump([row.__dict__ for row in rows], handle, indent=1)
    return 0


def _fmt(value: float, digits: int) -> str:
    return "-" if value is None or math.isnan(value) else f"{value:.{digits}f}"


def format_p2p(rows: list[P2PRow], transports: list[str], markdown: bool = False) -> str:
    """A table with one line per size: round trip (us) and bandwidth (GB/s) per transport."""
    by_key = {(row.transport, row.nbytes): row for row in rows}
    sizes = sorted({row.nbytes for row in rows})
    raw = any(row.transport == "raw-tcp-socket" for row in rows)
    floor = "shm" in transports and any(row.transport == "floor" for row in rows)
    header = ["bytes"]
    for name in transports:
        header += [f"{name} rtt us", f"{name} GB/s"]
    if floor:
        header += ["floor rtt us", "shm rtt / floor"]
    if raw:
        header += ["raw tcp GB/s"]
        if "shm" in transports:
            header += ["shm / raw tcp"]
    lines = []
    for nbytes in sizes:
        cells = [str(nbytes)]
        for name in transports:
            row = by_key.get((name, nbytes))
            cells += [_fmt(row.rtt_us, 1) if row else "-", _fmt(row.bandwidth_gbs, 3) if row else "-"]
        if floor:
            bare, shm = by_key.get(("floor", nbytes)), by_key.get(("shm", nbytes))
            cells += [_fmt(bare.rtt_us, 1) if bare else "-",
                      _fmt(shm.rtt_us / bare.rtt_us, 2) if bare and shm and bare.rtt_us else "-"]
        if raw:
            ref = by_key.get(("raw-tcp-socket", nbytes))
            cells.append(_fmt(ref.bandwidth_gbs, 3) if ref else "-")
            if "shm" in transports:
                shm = by_key.get(("shm", nbytes))
                ratio = shm.bandwidth_gbs / ref.bandwidth_gbs if shm and ref and ref.bandwidth_gbs else float("nan")
                cells.append(_fmt(ratio, 2))
        lines.append(cells)
    if markdown:
        out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        out += ["| " + " | ".join(cells) + " |" for cells in lines]
        return "\n".join(out)
    widths = [max(len(h), *(len(c[i]) for c in lines)) for i, h in enumerate(header)]
    out = ["  ".join(h.rjust(w) for h, w in zip(header, widths))]
    out += ["  ".join(c.rjust(w) for c, w in zip(cells, widths)) for cells in lines]
    return "\n".join(out)
