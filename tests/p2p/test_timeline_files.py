"""TCOLL_TRACE's files: never written through a link another user planted, never a reason for close() to fail."""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path

import pytest

from tcoll.p2p import timeline

pytestmark = pytest.mark.timeout(60)

VICTIM = b"a file the stranger wants overwritten\n"


def _victim(tmp_path: Path) -> Path:
    victim = tmp_path / "elsewhere" / "victim"
    victim.parent.mkdir()
    victim.write_bytes(VICTIM)
    return victim


@pytest.mark.parametrize("planted", ["part", "old temp name"])
def test_a_rank_writes_no_file_through_a_planted_link(tmp_path: Path, planted: str) -> None:
    victim = _victim(tmp_path)
    path = str(tmp_path / "run.json")
    link = timeline.part_path(path, 0) + (".tmp" if planted == "old temp name" else "")
    os.symlink(victim, link)
    line = timeline.Timeline(path, 0)
    line.slice("all_reduce", 1.0, 2.0, {"bytes": 8})
    assert line.write()
    assert victim.read_bytes() == VICTIM
    part = Path(timeline.part_path(path, 0))
    assert not part.is_symlink() and json.loads(part.read_text())[-1]["name"] == "all_reduce"
    assert part.stat().st_mode & 0o077 == 0  # made by this rank, for this user
    assert {p.name for p in tmp_path.iterdir()} == {"elsewhere", part.name, Path(link).name}  # no temp left


def test_merge_reads_no_planted_part_and_writes_through_no_link(tmp_path: Path) -> None:
    victim = _victim(tmp_path)
    forged = tmp_path / "elsewhere" / "forged.json"
    forged.write_text(json.dumps([{"name": "forged", "ph": "X", "pid": 9, "tid": 0, "ts": 0, "dur": 1}]))
    path = str(tmp_path / "run.json")
    for rank in range(2):
        line = timeline.Timeline(path, rank)
        line.slice("all_reduce", 1.0, 2.0, {"bytes": 8})
        line.write()
    os.symlink(forged, timeline.part_path(path, 2))  # a part no rank wrote
    os.symlink(victim, path)  # and the merged file aimed at the victim
    with pytest.warns(RuntimeWarning, match="not merging"):
        assert timeline.merge(path) == 2
    assert victim.read_bytes() == VICTIM
    merged = Path(path)
    assert not merged.is_symlink()
    events = json.loads(merged.read_text())["traceEvents"]
    assert "forged" not in {e["name"] for e in events}
    assert sorted(e["pid"] for e in events if e["ph"] == "X") == [0, 1]
    assert os.path.islink(timeline.part_path(path, 2))  # left where it was, unread


@pytest.mark.skipif(os.geteuid() != 0, reason="making a file of another user needs root")
def test_merge_refuses_another_users_part(tmp_path: Path) -> None:
    path = str(tmp_path / "run.json")
    line = timeline.Timeline(path, 0)
    line.write()
    theirs = Path(timeline.part_path(path, 1))
    theirs.write_text(json.dumps([{"name": "theirs", "ph": "X", "pid": 1, "tid": 0, "ts": 0, "dur": 1}]))
    os.chown(theirs, 54321, 54321)
    with pytest.warns(RuntimeWarning, match="not a file of this user"):
        assert timeline.merge(path) == 1
    assert "theirs" not in {e["name"] for e in json.loads(Path(path).read_text())["traceEvents"]}


def test_an_unwritable_trace_path_warns_at_close(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import tcoll

    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("TCOLL_TRACE", str(blocker / "run.json"))  # its directory is a file: nothing can be made
    monkeypatch.delenv("TCOLL_RANK", raising=False)
    comm = tcoll.init(run_id="trace-unwritable")
    comm.barrier()
    with pytest.warns(RuntimeWarning, match="could not write its timeline"):
        comm.close()
    assert comm.closed
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert not timeline.Timeline(str(blocker / "run.json"), 0).write()
