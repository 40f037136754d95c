"""`tcoll trace` draws recorded schedules; docs/collectives.md shows one picture per algorithm, from the code."""

from __future__ import annotations

from pathlib import Path

import pytest

import tcoll.comm.dispatch  # noqa: F401 - registers every algorithm
from tcoll import cli
from tcoll.algos.registry import REGISTRY

pytest.importorskip("matplotlib")

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("steps", [False, True])
def test_trace_writes_png_and_svg(tmp_path: Path, capsys: pytest.CaptureFixture[str], steps: bool) -> None:
    for name, magic in (("ring.png", b"\x89PNG"), ("ring.svg", b"<?xml")):
        argv = ["trace", "all_reduce", "--algorithm", "ring", "-n", "4", "--size", "16", "-o", str(tmp_path / name)]
        assert cli.main(argv + (["--steps"] if steps else [])) == 0
        assert (tmp_path / name).read_bytes().startswith(magic)
    assert "24 messages in 6 steps" in capsys.readouterr().out


def test_trace_draws_a_shared_memory_algorithm(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["trace", "all_reduce", "--algorithm", "shm", "-n", "4", "--size", "16", "-o", str(tmp_path / "x.svg")]
    assert cli.main(argv) == 0
    assert "20 slot copies in 1 step" in capsys.readouterr().out  # 4 writes, 4 x 4 reads to reduce
    assert "rank 3's slot" in (tmp_path / "x.svg").read_text()
    argv = ["trace", "all_reduce", "--algorithm", "shm", "-n", "4", "--size", "512", "--chunk", "256",
            "-o", str(tmp_path / "x.png")]
    assert cli.main(argv) == 0 and "in 4 steps" in capsys.readouterr().out  # two pieces of two steps


def test_trace_refuses_what_it_cannot_draw(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["trace", "all_reduce", "--algorithm", "shm", "--steps", "-o", str(tmp_path / "x.png")]
    assert cli.main(argv) == 2
    assert "sends no messages" in capsys.readouterr().err
    assert cli.main(["trace", "all_reduce", "--algorithm", "ring", "-o", str(tmp_path / "x.pdf")]) == 2
    assert ".png or .svg" in capsys.readouterr().err
    assert cli.main(["trace", "all_reduce", "--algorithm", "nope", "-o", str(tmp_path / "x.png")]) == 2
    assert "choose 'auto' or one of" in capsys.readouterr().err


def test_every_algorithm_has_its_picture_in_the_docs() -> None:
    text = (ROOT / "docs" / "collectives.md").read_text()
    for collective, infos in REGISTRY.items():
        for name, info in infos.items():
            if info.hierarchical:  # made of the pictured algorithms, on teams of hosts (docs/scaling.md)
                continue
            picture = f"img/schedule-{collective}-{name}.svg"
            assert (ROOT / "docs" / picture).exists() and f"({picture})" in text, picture
