"""Pictures of a recorded schedule (tcoll.algos.record), drawn with matplotlib (the "plot" extra).

`draw` puts ranks on rows and steps on columns: an arrow from (step, src) to
(step + 1, dst) is a message, coloured by the block its data starts in
(grey for scratch data), and a dot is a combine. `draw_steps` gives one panel
per step with the ranks on a circle, for teaching: who sends which block to
whom, step by step.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from ..algos.explaining import format_bytes
from ..algos.record import Schedule

__all__ = ["draw", "draw_steps", "save"]


def _pyplot() -> Any:
    """matplotlib.pyplot on a file-only backend, or ImportError saying how to get it."""
    try:
        import matplotlib
    except ImportError as exc:
        raise ImportError("tcoll trace draws with matplotlib: pip install 'tcoll[plot]'") from exc
    matplotlib.use("Agg")
    matplotlib.rcParams["svg.fonttype"] = "none"  # text stays text: small files that diff
    matplotlib.rcParams["svg.hashsalt"] = "tcoll"  # the same schedule gives the same file
    import matplotlib.pyplot as plt

    return plt


def _colour(block: int, blocks: int) -> Any:
    plt = _pyplot()
    if block < 0:
        return (0.55, 0.55, 0.55)
    return plt.get_cmap("tab10" if blocks <= 10 else "tab20")(block % 20)


def _title(schedule: Schedule) -> str:
    return (f"{schedule.collective} {schedule.algorithm}: {schedule.size} ranks, "
            f"{format_bytes(schedule.nbytes)} per rank, {len(schedule.messages)} messages in "
            f"{schedule.steps} step{'s' if schedule.steps != 1 else ''}")


def _legend(ax: Any, schedule: Schedule) -> None:
    from matplotlib.lines import Line2D

    used = sorted({m.block for m in schedule.messages})
    handles = [Line2D([], [], color=_colour(b, schedule.size), lw=2,
                      label="scratch" if b < 0 else f"block {b}") for b in used]
    if schedule.reductions:
        handles.append(Line2D([], [], color="black", marker="o", lw=0, markersize=5, label="combine"))
    if handles:
        ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)


def draw(schedule: Schedule) -> Any:
    """The whole schedule in one figure: ranks are rows, steps are columns. Returns the Figure."""
    plt = _pyplot()
    p, steps = schedule.size, max(1, schedule.steps)
    fig, ax = plt.subplots(figsize=(1.6 + 1.1 * steps, 0.9 + 0.55 * p))
    lanes: dict[tuple[int, int, int], int] = {}
    for m in schedule.messages:  # several messages of one pair in one step (chunks) fan out a little
        lane = lanes.get((m.step, m.src, m.dst), 0)
        lanes[(m.step, m.src, m.dst)] = lane + 1
        bend = 0.12 * lane * (1 if lane % 2 else -1)
        ax.annotate("", xy=(m.step + 1, m.dst), xytext=(m.step, m.src),
                    arrowprops={"arrowstyle": "-|>", "color": _colour(m.block, p), "lw": 1.4,
                                "shrinkA": 4, "shrinkB": 4, "connectionstyle": f"arc3,rad={bend}"})
    for r in schedule.reductions:
        ax.plot(r.step, r.rank, "o", color="black", markersize=4)
    ax.set_xlim(-0.4, steps + 0.4)
    ax.set_ylim(p - 0.5, -0.5)
    ax.set_xticks(range(steps + 1))
    ax.set_yticks(range(p), [f"rank {r}" for r in range(p)])
    ax.set_xlabel("step (message latencies)")
    ax.grid(axis="x", color="0.9")
    ax.set_title(_title(schedule), fontsize=10)
    _legend(ax, schedule)
    fig.tight_layout()
    return fig


def draw_steps(schedule: Schedule) -> Any:
    """One panel per step, the ranks on a circle and that step's messages as arrows. Returns the Figure."""
    plt = _pyplot()
    p, steps = schedule.size, max(1, schedule.steps)
    columns = min(steps, 4)
    rows = math.ceil(steps / columns)
    fig, axes = plt.subplots(rows, columns, figsize=(3.0 * columns, 3.1 * rows + 0.4), squeeze=False)
    where = [(math.sin(2 * math.pi * r / p), math.cos(2 * math.pi * r / p)) for r in range(p)]
    for step in range(rows * columns):
        ax = axes[step // columns][step % columns]
        ax.set_axis_off()
        if step >= steps:
            continue
        ax.set_xlim(-1.35, 1.35)
        ax.set_ylim(-1.35, 1.35)
        ax.set_aspect("equal")
        ax.set_title(f"step {step}", fontsize=9)
        for m in (m for m in schedule.messages if m.step == step):
            ax.annotate("", xy=where[m.dst], xytext=where[m.src],
                        arrowprops={"arrowstyle": "-|>", "color": _colour(m.block, p), "lw": 1.6,
                                    "shrinkA": 11, "shrinkB": 11, "connectionstyle": "arc3,rad=0.15"})
        combining = {r.rank for r in schedule.reductions if r.step == step + 1}
        for rank, (x, y) in enumerate(where):
            face = "0.85" if rank in combining else "white"
            ax.text(x, y, str(rank), ha="center", va="center", fontsize=9,
                    bbox={"boxstyle": "circle", "facecolor": face, "edgecolor": "black"})
    fig.suptitle(_title(schedule) + "\n(shaded: the rank combines what it received)", fontsize=10)
    fig.tight_layout()
    return fig


def save(fig: Any, path: str | Path) -> None:
    """Write the figure to a .png or .svg file and close it.

    Raises:
        ValueError: another extension.
    """
    path = Path(path)
    if path.suffix.lower() not in (".png", ".svg"):
        raise ValueError(f"write a .png or .svg file, not {path.name}")
    fig.savefig(path, dpi=100, metadata={"Date": None} if path.suffix.lower() == ".svg" else None)
    _pyplot().close(fig)
