"""all_reduce across 2 namespace-hosts x 2 ranks with `tc netem` delay between them: hierarchical vs flat.

    sudo python benchmarks/hosts_netem.py                    # 1 ms, 64 KiB .. 16 MiB
    sudo python benchmarks/hosts_netem.py --delay 0ms --sizes 1M,4M --iters 10
    sudo python benchmarks/hosts_netem.py --rate 1gbit       # also cap each host's link (tc tbf)

Builds two hosts with their own network namespace, hostname and /dev/shm
(tests/helpers/netns.py), adds `tc qdisc add dev eth0 root netem delay D` in
each (so a message between hosts takes D more), and runs `tcoll run --nnodes 2
-n 2` of this file's worker in each. The worker sweeps the sizes with the
timing loop of `tcoll bench` (tcoll.bench.sweep: warm-up, barrier, `iters`
back-to-back calls, the slowest rank's mean) for each algorithm, and notes
what algorithm="auto" chose at each size. Needs root.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ALGORITHMS = ["auto", "ring", "rabenseifner", "recursive_doubling", "hierarchical", "hierarchical_sliced"]


def worker(out: str, sizes: list[int], iters: int) -> None:
    """One rank: sweep every algorithm at every size; rank 0 writes the rows and auto's choices."""

    import tcoll
    from tcoll.bench.plan import BenchConfig, make_plan
    from tcoll.bench.tcoll_backend import tcoll_worker
    from tcoll.ops import OPS

    comm = tcoll.init()
    config = BenchConfig(cases=["all_reduce"], n=comm.size, sizes=sizes, iters=iters, warmup=3)
    plan = make_plan(config, "tcoll")
    plan["jobs"] = [{"case": "all_reduce", "label": "tcoll", "algorithm": name, "buffers": "plain"}
                    for name in ALGORITHMS]
    result = tcoll_worker(comm, plan)
    chosen = {n: comm.core.dispatch.choose("all_reduce", "auto", n, OPS["sum"], blocking=True, itemsize=4).name
              for n in sizes}
    if comm.rank == 0:
        result["chosen"] = chosen
        result["latency"] = comm.core.engine.link_latency
        result["hosts"] = comm.hosts.host_of
        Path(out).write_text(json.dumps(result))
    comm.barrier()
    comm.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--delay", default="1ms", help="netem delay added on each host's link (default 1ms)")
    parser.add_argument("--rate", default="", help="also cap each host's link, e.g. 1gbit (tc tbf; default: none)")
    parser.add_argument("--sizes", default="64K,256K,1M,4M,16M")
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--worker", nargs=2, metavar=("OUT", "SIZES"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    sys.path[:0] = [str(ROOT / "src"), str(ROOT / "tests")]
    from tcoll.env import parse_size

    sizes = [parse_size(s) for s in args.sizes.split(",")]
    if args.worker:
        worker(args.worker[0], [int(s) for s in args.worker[1].split(",")], args.iters)
        return
    from helpers import netns

    why = netns.unavailable()
    if why:
        sys.exit(f"cannot make namespace-hosts: {why}")
    with tempfile.TemporaryDirectory() as tmp, netns.namespace_hosts(2) as hosts:
        delay = args.delay
        if delay not in ("0", "0ms"):
            for host in range(2):
                try:
                    hosts.run_in(host, "tc", "qdisc", "add", "dev", "eth0", "root", "netem", "delay", delay)
                except subprocess.CalledProcessError as exc:
                    print(f"tc netem is not available here ({exc.stderr.strip()}): measuring with no delay added")
                    delay = "0ms (netem unavailable)"
                    break
        if args.rate:  # a bandwidth cap: a token bucket on each host's link (a child of netem when there is one)
            parent = ["parent", "1:"] if not delay.startswith("0") else ["root"]
            if parent[0] == "parent":
                for host in range(2):
                    hosts.run_in(host, "tc", "qdisc", "replace", "dev", "eth0", "root", "handle", "1:", "netem",
                                 "delay", delay)
            for host in range(2):
                hosts.run_in(host, "tc", "qdisc", "add", "dev", "eth0", *parent, "tbf", "rate", args.rate,
                             "burst", "256kb", "latency", "100ms")
            delay = f"{delay}, rate {args.rate}"
        out = os.path.join(tmp, "result.json")
        script = [__file__, "--iters", str(args.iters), "--worker", out, ",".join(map(str, sizes))]
        results = netns.wait_all(hosts.tcoll_run(2, script), 1800)
        if any(code != 0 for code, _ in results):
            sys.exit("\n".join(f"host {i} exit {code}:\n{text}" for i, (code, text) in enumerate(results)))
        result = json.loads(Path(out).read_text())
    report(result, delay)


def report(result: dict, delay: str) -> None:
    """Print time per call (ms) for each size and algorithm, and auto's choice."""
    rows = result["rows"]
    times = {(row["nbytes"], row["algorithm"]): row["time"] for row in rows}
    sizes = sorted({row["nbytes"] for row in rows})
    print(f"all_reduce float32 sum, 2 hosts x 2 ranks (hosts {result['hosts']}), per host link: netem delay {delay}; "
          f"measured one-way latency {result['latency'] * 1e3:.2f} ms; time per call in ms (slowest rank's mean)")
    print(f"| bytes | {' | '.join(ALGORITHMS)} | auto chose | flat ring / best hierarchical |")
    print("|" + "---|" * (len(ALGORITHMS) + 3))
    for n in sizes:
        cells = [times.get((n, a)) for a in ALGORITHMS]
        hier = min(t for t in (times.get((n, "hierarchical")), times.get((n, "hierarchical_sliced"))) if t)
        ring = times.get((n, "ring"))
        text = " | ".join(f"{t * 1e3:.2f}" if t else "-" for t in cells)
        print(f"| {n} | {text} | {result['chosen'][str(n)]} | {ring / hier:.2f}x |")


if __name__ == "__main__":
    main()
