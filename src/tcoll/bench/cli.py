"""`tcoll bench`: the benchmark commands (argparse only; the work is in the bench modules)."""

from __future__ import annotations

import argparse
import json
import math
import sys

from ..env import parse_size
from .machine import describe_machine
from .p2p import P2PRow, run_p2p, sizes_between

__all__ = ["add_arguments", "main"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Fill the `tcoll bench` subparser."""
    parser.add_argument("case", choices=["p2p"], help="what to measure: p2p = ping-pong latency and bandwidth")
    parser.add_argument("-b", "--minbytes", default="8", help="smallest message (default 8)")
    parser.add_argument("-e", "--maxbytes", default="256M", help="largest message (default 256M)")
    parser.add_argument("-f", "--stepfactor", type=int, default=4, help="size multiplier between rows (default 4)")
    parser.add_argument("--transports", default="shm,tcp", help="comma-separated (default shm,tcp)")
    parser.add_argument("--repeats", type=int, default=3, help="repetitions per size; medians reported (default 3)")
    parser.add_argument("--no-raw-tcp", dest="raw_tcp", action="store_false",
                        help="skip the plain TCP loopback socket reference")
    parser.add_argument("--json", metavar="FILE", help="also write every sample as JSON")
    parser.add_argument("--markdown", action="store_true", help="print the table as Markdown")


def main(args: argparse.Namespace) -> int:
    """Run a benchmark and print its table."""
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
    header = ["bytes"]
    for name in transports:
        header += [f"{name} rtt us", f"{name} GB/s"]
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
