"""`tcoll bench` says on a terminal which case, size and library it measures, and what is left."""

from __future__ import annotations

import io
import time
from pathlib import Path

from tcoll.bench.report import Progress


def test_the_progress_line_names_the_measurement(tmp_path: Path) -> None:
    out = io.StringIO()
    progress = Progress(out, tty=True)
    progress.start(4)
    path = tmp_path / "dots"
    path.write_text("")
    watch = progress.watch(str(path), "tcoll 1/1", ["all_reduce 8 B", "all_reduce 64 MiB", "barrier 8 B"])
    path.write_text(".")  # rank 0 finished the first measurement: the second runs
    deadline = time.monotonic() + 10
    while "all_reduce 64 MiB on tcoll 1/1" not in out.getvalue():
        assert time.monotonic() < deadline, out.getvalue()
        time.sleep(0.05)
    assert watch.close() == 1
    assert "1/4" in out.getvalue() and "eta" in out.getvalue()
    progress.close()
    assert out.getvalue().endswith("# 1 measurements in " + out.getvalue().rsplit(" in ", 1)[1])


def test_no_progress_line_off_a_terminal(tmp_path: Path) -> None:
    out = io.StringIO()
    progress = Progress(out, tty=False)
    progress.start(2)
    (tmp_path / "dots").write_text("..")
    progress.watch(str(tmp_path / "dots"), "gloo 1/1", ["a", "b"]).close()
    progress.close()
    assert "\r" not in out.getvalue() and out.getvalue().startswith("# 2 measurements in ")
