"""Record a 4-rank DDP run with `tcoll run --trace` and draw one training step of its timeline (needs matplotlib).

    PYTHONPATH=src python scripts/draw_timeline.py [--trace run.json] [--out docs/img/timeline-ddp]

Without --trace it runs examples/ddp_train.py (one epoch) on 4 ranks with the gradient
all_reduce forced onto the ring algorithm (`TCOLL_ALGO=all_reduce=ring`), whose
messages show as flows (the default shm algorithm sends none). From the job's trace it
keeps the events of one training step, two consecutive gradient all_reduces and the
compute between them, and writes them to <out>.json (a trace-event file that
ui.perfetto.dev opens), then draws that very file to <out>.png: every rank a row,
every collective a labelled slice, every message a line from sender to receiver.
docs/torch.md shows the picture; run this again to regenerate both.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def load(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The events of a trace-event file (the object form or a bare list)."""
    with open(path) as f:
        data = json.load(f)
    return data["traceEvents"] if isinstance(data, dict) else data


def step_window(events: list[dict[str, Any]], index: int | None = None) -> tuple[float, float]:
    """(start, end) in us of one DDP step: from the first rank entering gradient all_reduce `index` (default:
    the middle one) to the last rank leaving the next one.

    Raises:
        ValueError: the trace holds fewer than two all_reduce calls of the gradients' size.
    """
    calls = [e for e in events if e["ph"] == "X" and e.get("cat") == "collective" and e["name"] == "all_reduce"]
    size = max((e["args"].get("bytes", 0) for e in calls), default=0)  # the gradient bucket, not the loss
    sequences = sorted({e["args"]["sequence"] for e in calls if e["args"].get("bytes") == size})
    if len(sequences) < 2:
        raise ValueError("the trace holds fewer than two gradient all_reduces")
    at = min(len(sequences) // 2, len(sequences) - 2) if index is None else index
    first, second = sequences[at], sequences[at + 1]
    start = min(e["ts"] for e in calls if e["args"]["sequence"] == first)
    end = max(e["ts"] + e["dur"] for e in calls if e["args"]["sequence"] == second)
    return start, end


def cut(events: list[dict[str, Any]], start: float, end: float) -> list[dict[str, Any]]:
    """The metadata and the events inside [start, end]; a flow only when both its ends are inside."""
    inside = [e for e in events if e["ph"] == "M" or (start <= e["ts"] and e["ts"] + e.get("dur", 0) <= end)]
    ends = {}
    for e in inside:
        if e["ph"] in ("s", "f"):
            ends.setdefault(e["id"], set()).add(e["ph"])
    return [e for e in inside if e["ph"] not in ("s", "f") or ends[e["id"]] == {"s", "f"}]


def _label(event: dict[str, Any]) -> str:
    args = event.get("args", {})
    text = f"{event['name']} #{args['sequence']}" if "sequence" in args else event["name"]
    if "algorithm" in args:
        text += f"\n{args['algorithm']}, {args.get('bytes', 0)} B"
    return text


def render(events: list[dict[str, Any]], output: str | os.PathLike[str], title: str = "") -> Any:
    """Draw the trace `events` to `output` (.png or .svg): ranks are rows, time runs right. Returns the Figure."""
    import matplotlib

    matplotlib.use("Agg")
    matplotlib.rcParams["svg.hashsalt"] = "tcoll"
    import matplotlib.pyplot as plt

    names = {e["pid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    ranks = sorted({e["pid"] for e in events} | set(names))
    row = {pid: i for i, pid in enumerate(ranks)}
    timed = [e for e in events if e["ph"] != "M"]
    t0 = min((e["ts"] for e in timed), default=0.0)
    span = max((e["ts"] + e.get("dur", 0) - t0 for e in timed), default=1.0) / 1000 or 1.0
    fig, ax = plt.subplots(figsize=(11, 1.0 + 0.9 * len(ranks)))
    colours = plt.get_cmap("tab10")
    kinds: dict[str, int] = {}
    for e in (e for e in timed if e["ph"] == "X" and e.get("tid", 0) == 0):
        start, width = (e["ts"] - t0) / 1000, e["dur"] / 1000
        colour = colours(kinds.setdefault(e["name"], len(kinds)) % 10)
        ax.broken_barh([(start, width)], (row[e["pid"]] - 0.32, 0.64), facecolors=colour, edgecolor="black", lw=0.5,
                      alpha=0.6)
        if width > span / 25:
            ax.text(start + width / 2, row[e["pid"]], _label(e), ha="center", va="center", fontsize=7)
    starts = {e["id"]: e for e in timed if e["ph"] == "s"}
    for f in (e for e in timed if e["ph"] == "f" and e["id"] in starts):
        s = starts[f["id"]]
        ax.annotate("", xy=((f["ts"] - t0) / 1000, row[f["pid"]]), xytext=((s["ts"] - t0) / 1000, row[s["pid"]]),
                    arrowprops={"arrowstyle": "-|>", "color": "0.25", "lw": 0.6, "alpha": 0.6, "mutation_scale": 6})
    ax.set_yticks(range(len(ranks)), [names.get(pid, f"rank {pid}") for pid in ranks])
    ax.set_ylim(len(ranks) - 0.5, -0.5)
    ax.set_xlim(0, span)
    ax.set_xlabel("ms")
    ax.set_title(title, fontsize=10)
    ax.grid(axis="x", color="0.92")
    fig.tight_layout()
    fig.savefig(output, dpi=110)
    plt.close(fig)
    return fig


def record(trace: Path) -> None:
    """Run examples/ddp_train.py for one epoch on 4 ranks under `tcoll run --trace`, all_reduce on the ring."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")])))
    subprocess.run([sys.executable, "-m", "tcoll", "run", "-n", "4", "--trace", str(trace),
                    "--env", "TCOLL_ALGO=all_reduce=ring", str(ROOT / "examples" / "ddp_train.py"), "--epochs", "1"],
                   check=True, env=env)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trace", type=Path, help="a trace of a DDP run (default: record one)")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "img" / "timeline-ddp",
                        help="writes OUT.json (the step's events) and OUT.png (their picture)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        trace = args.trace
        if trace is None:
            trace = Path(tmp) / "ddp.json"
            record(trace)
        events = load(trace)
    step = cut(events, *step_window(events))
    cut_path = args.out.with_suffix(".json")
    with open(cut_path, "w") as out:
        json.dump({"traceEvents": step, "displayTimeUnit": "ms", "otherData": {"producer": "tcoll"}}, out)
    render(load(cut_path), args.out.with_suffix(".png"),
           f"One DDP training step on 4 ranks (examples/ddp_train.py, all_reduce on the ring), "
           f"drawn from {cut_path.name}")
    print(f"{cut_path} and {args.out.with_suffix('.png')}: {len(step)} events")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
