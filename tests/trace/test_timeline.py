"""TCOLL_TRACE / `tcoll run --trace`: one trace-event JSON for the job, every rank a track with its collectives,
the steps of multi-step calls, and every point-to-point message as a flow."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from collections import Counter
from pathlib import Path

import pytest

from tcoll.p2p import timeline

SRC = Path(__file__).resolve().parents[2] / "src"

# The trace-event format (Chrome's "Trace Event Format" document, as Perfetto reads it), the parts used here.
_NUMBER = {"type": "number"}
SCHEMA = {
    "type": "object",
    "required": ["traceEvents"],
    "properties": {
        "displayTimeUnit": {"enum": ["ms", "ns"]},
        "traceEvents": {"type": "array", "items": {
            "type": "object",
            "required": ["name", "ph", "pid", "tid"],
            "properties": {"name": {"type": "string"}, "ph": {"enum": ["X", "s", "f", "M"]},
                           "pid": {"type": "integer"}, "tid": {"type": "integer"}, "ts": _NUMBER,
                           "dur": _NUMBER, "cat": {"type": "string"}, "args": {"type": "object"},
                           "id": {"type": "string"}, "bp": {"enum": ["e"]}},
            "allOf": [
                {"if": {"properties": {"ph": {"const": "X"}}}, "then": {"required": ["ts", "dur"]}},
                {"if": {"properties": {"ph": {"enum": ["s", "f"]}}}, "then": {"required": ["ts", "id", "cat"]}},
                {"if": {"properties": {"ph": {"const": "M"}}}, "then": {"required": ["args"]}},
            ]}},
    },
}

JOB = """
    import numpy as np, tcoll
    comm = tcoll.init()
    x = np.ones(4096, dtype=np.float32)
    comm.all_reduce(x, algorithm="ring")                  # point-to-point: messages as flows
    comm.all_reduce(x)                                     # shm direct
    comm.all_reduce(x, async_op=True).wait()               # async: ends when its Work does
    comm.all_gatherv(np.ones(comm.rank + 1))               # a program of two steps
    comm.broadcast(x, root=1, algorithm="binomial")
    comm.close()
"""


@pytest.mark.timeout(120)
def test_a_four_rank_run_gives_one_valid_trace(tmp_path: Path) -> None:
    (tmp_path / "job.py").write_text(textwrap.dedent(JOB))
    env = {k: v for k, v in os.environ.items() if not k.startswith("TCOLL_")}
    env["PYTHONPATH"] = str(SRC)
    result = subprocess.run([sys.executable, "-m", "tcoll", "run", "-n", "4", "--trace", "run.json", "job.py"],
                            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=110)
    assert result.returncode == 0, result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["job.py", "run.json"]  # parts merged and removed
    trace = json.loads((tmp_path / "run.json").read_text())
    try:
        import jsonschema
    except ImportError:
        jsonschema = None
    if jsonschema is not None:
        jsonschema.validate(trace, SCHEMA)
    events = trace["traceEvents"]
    assert {e["args"]["name"] for e in events if e["name"] == "process_name"} == {f"rank {r}" for r in range(4)}
    calls = [e for e in events if e.get("cat") == "collective" and not e["name"].startswith("step ")]
    for rank in range(4):
        mine = sorted((e for e in calls if e["pid"] == rank), key=lambda e: e["args"]["sequence"])
        assert [e["name"] for e in mine] == ["all_reduce"] * 3 + ["all_gatherv", "broadcast"]
        assert [e["args"]["algorithm"] for e in mine[:2]] == ["ring", "shm"]
        assert mine[2]["args"]["algorithm"] not in ("shm", "auto")  # an async call runs point-to-point
        assert [e["args"]["algorithm"] for e in mine[3:]] == ["auto", "binomial"]
        assert [e["args"]["sequence"] for e in mine] == [1, 2, 3, 4, 5]
        assert mine[0]["args"]["bytes"] == 4096 * 4 and all(e["dur"] > 0 for e in mine)
        steps = [e for e in events if e["pid"] == rank and e["name"].startswith("step ")]
        assert [e["args"]["phase"] for e in steps] == [0, 2]
    # every message is a flow from its sender's track to its receiver's, each end exactly once
    starts = Counter(e["id"] for e in events if e["ph"] == "s")
    ends = Counter(e["id"] for e in events if e["ph"] == "f")
    assert starts == ends and set(starts.values()) == {1}
    ring = [e for e in events if e["ph"] == "X" and e.get("cat") == "p2p" and e["args"].get("sequence") == 1]
    assert len([e for e in ring if e["name"].startswith("send")]) == 4 * 2 * 3  # 2(p-1) messages per rank


def test_off_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TCOLL_TRACE", raising=False)
    assert timeline.from_env(0) is None


def test_merge_joins_the_parts(tmp_path: Path) -> None:
    path = str(tmp_path / "t.json")
    for rank in range(3):
        line = timeline.Timeline(path, rank)
        line.slice("all_reduce", 1.0, 2.0, {"bytes": 8})
        line.write()
    assert timeline.merge(path) == 3
    events = json.loads(Path(path).read_text())["traceEvents"]
    assert sorted(e["pid"] for e in events if e["ph"] == "X") == [0, 1, 2]
    assert not list(tmp_path.glob("t.json.rank*"))


def _ring_all_reduce(comm):  # type: ignore[no-untyped-def]
    import numpy as np

    comm.all_reduce(np.ones(64, dtype=np.float32), algorithm="ring")


@pytest.mark.timeout(60)
def test_spawn_merges_the_timeline_too(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import tcoll

    path = tmp_path / "spawned.json"
    monkeypatch.setenv("TCOLL_TRACE", str(path))
    tcoll.spawn(_ring_all_reduce, 3, threads=True)
    events = json.loads(path.read_text())["traceEvents"]
    calls = [e for e in events if e.get("cat") == "collective"]
    assert sorted(e["pid"] for e in calls) == [0, 1, 2] and {e["args"]["algorithm"] for e in calls} == {"ring"}
    assert not list(tmp_path.glob("spawned.json.rank*"))
