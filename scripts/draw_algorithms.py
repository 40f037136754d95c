"""Draw every algorithm's schedule into docs/img, with `tcoll trace` (needs matplotlib).

    PYTHONPATH=src python scripts/draw_algorithms.py [--ranks 4] [--out docs/img]

One picture per algorithm, docs/img/schedule-<collective>-<algorithm>.svg: ranks are rows,
steps are columns, an arrow is a message coloured by the block it carries, a dot a combine; the
shared-memory (direct) ones show their arena steps: slot writes, and lines to the ranks reading them.
docs/collectives.md shows them; run this again when an algorithm changes.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import tcoll.comm.dispatch  # noqa: F401 - registers every algorithm
from tcoll import cli
from tcoll.algos.registry import REGISTRY

ROOT = Path(__file__).resolve().parents[1]
# all_reduce and reduce on the arena change method above one slot: show two 256-byte pieces of the large one
DIRECT_SIZES = {"all_reduce": ["--size", "512", "--chunk", "256"], "reduce": ["--size", "512", "--chunk", "256"]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "img")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    for collective, infos in REGISTRY.items():
        for name, info in infos.items():
            if info.hierarchical:  # steps of the algorithms drawn here, on teams of hosts: see docs/scaling.md
                continue
            path = args.out / f"schedule-{collective}-{name}.svg"
            size = DIRECT_SIZES.get(collective, ["--size", "16"]) if info.direct else ["--size", "16"]
            code = cli.main(["trace", collective, "--algorithm", name, "-n", str(args.ranks), *size,
                             "-o", str(path)])
            if code:
                return code
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
