"""scripts/draw_timeline.py cuts one DDP step out of a `tcoll run --trace` file and draws it; docs/img holds
the cut of a real 4-rank run and its picture."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers.procs import load_script

pytest.importorskip("matplotlib")

ROOT = Path(__file__).resolve().parents[2]
draw_timeline = load_script(ROOT / "scripts" / "draw_timeline.py", "draw_timeline")


def _trace() -> list[dict]:
    """Two ranks, three 64-byte all_reduces and a 4-byte one, one message each way in every call."""
    events: list[dict] = []
    for rank in (0, 1):
        events.append({"name": "process_name", "ph": "M", "pid": rank, "tid": 0, "args": {"name": f"rank {rank}"}})
    for sequence, (start, nbytes) in enumerate([(0, 64), (1000, 4), (2000, 64), (3000, 64)], 1):
        for rank in (0, 1):
            args = {"collective": "all_reduce", "bytes": nbytes, "algorithm": "ring", "sequence": sequence}
            events.append({"name": "all_reduce", "cat": "collective", "ph": "X", "ts": start + 10 * rank,
                           "dur": 500, "pid": rank, "tid": 0, "args": args})
            flow = f"{rank}>{1 - rank}:1:{sequence}:0"
            events.append({"name": "message", "cat": "p2p", "ph": "s", "id": flow, "ts": start + 100,
                           "pid": rank, "tid": 1})
            events.append({"name": "message", "cat": "p2p", "ph": "f", "bp": "e", "id": flow, "ts": start + 200,
                           "pid": 1 - rank, "tid": 1})
    return events


def test_a_step_is_cut_and_drawn(tmp_path: Path) -> None:
    events = _trace()
    start, end = draw_timeline.step_window(events)  # the middle gradient call (#3) and the next (#4)
    assert (start, end) == (2000, 3510)
    step = draw_timeline.cut(events, start, end)
    assert sorted({e["args"]["sequence"] for e in step if e["ph"] == "X"}) == [3, 4]
    assert sum(e["ph"] == "s" for e in step) == sum(e["ph"] == "f" for e in step) == 4
    half = draw_timeline.cut(events, start, 3150)  # the last call's messages start inside and end outside
    assert sum(e["ph"] == "s" for e in half) == 2 and sum(e["ph"] == "f" for e in half) == 2
    path = tmp_path / "step.json"
    path.write_text(json.dumps({"traceEvents": step}))
    fig = draw_timeline.render(draw_timeline.load(path), tmp_path / "step.png", "a step")
    assert (tmp_path / "step.png").read_bytes().startswith(b"\x89PNG")
    from matplotlib.text import Annotation

    labels = {t.get_text() for t in fig.axes[0].texts}
    arrows = [t for t in fig.axes[0].texts if isinstance(t, Annotation)]
    assert "all_reduce #3\nring, 64 B" in labels and len(arrows) == 4  # a flow arrow per message
    assert [t.get_text() for t in fig.axes[0].get_yticklabels()] == ["rank 0", "rank 1"]


def test_the_docs_picture_is_drawn_from_a_real_four_rank_step() -> None:
    events = draw_timeline.load(ROOT / "docs" / "img" / "timeline-ddp.json")
    calls = [e for e in events if e["ph"] == "X" and e.get("cat") == "collective"]
    assert {e["pid"] for e in calls} == {0, 1, 2, 3}
    for rank in range(4):  # both gradient all_reduces of the step on every rank
        assert len({e["args"]["sequence"] for e in calls if e["pid"] == rank}) == 2
    starts = {e["id"] for e in events if e["ph"] == "s"}
    assert starts and starts == {e["id"] for e in events if e["ph"] == "f"}
    assert (ROOT / "docs" / "img" / "timeline-ddp.png").exists()
    assert "img/timeline-ddp.png" in (ROOT / "docs" / "torch.md").read_text()
