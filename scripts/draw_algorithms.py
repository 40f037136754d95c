"""Draw every point-to-point algorithm's schedule into docs/img, with `tcoll trace` (needs matplotlib).

    PYTHONPATH=src python scripts/draw_algorithms.py [--ranks 4] [--out docs/img]

One picture per algorithm, docs/img/schedule-<collective>-<algorithm>.svg: ranks are rows,
steps are columns, an arrow is a message coloured by the block it carries, a dot a combine.
docs/collectives.md shows them; run this again when an algorithm changes.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import tcoll.comm.dispatch  # noqa: F401 - registers every algorithm
from tcoll import cli
from tcoll.algos.registry import REGISTRY

ROOT = Path(__file__).resolve().parents[1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "img")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    for collective, infos in REGISTRY.items():
        for name, info in infos.items():
            if info.direct:
                continue  # the shared-memory algorithms send no messages: nothing to draw
            path = args.out / f"schedule-{collective}-{name}.svg"
            code = cli.main(["trace", collective, "--algorithm", name, "-n", str(args.ranks), "--size", "16",
                             "-o", str(path)])
            if code:
                return code
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
