"""Results of `tcoll bench <collective>`: medians over repeats, the table, JSON, the plot, progress.

The table follows nccl-tests: size (B), count, dtype, op, time (us), algbw
and busbw (GB/s), #wrong; then, per compare target, its time and busbw and
tcoll's busbw over its busbw ("tcoll/gloo": above 1, tcoll is faster). For
one size both run the same bytes, so that ratio is also their time over
tcoll's, which is what it means for a barrier (no bytes). A compare target
with wrong elements at a size shows WRONG there instead of its time.
all_reduce's table also has "copy GB/s", each rank's memory-copy rate at the
row's size measured in the same run (bench.copyrate), and "busbw/copy",
tcoll's busbw as a fraction of it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import sys
import threading
import time
from collections.abc import Iterable
from typing import Any, TextIO

from .collectives import CASES

__all__ = ["COPY", "PlotUnavailable", "Progress", "Result", "aggregate", "check_plot", "format_tables", "plot",
           "write_json"]


COPY = "copy"  # the impl of the copy-rate rows (bench.copyrate): columns of their own, not a compare target


@dataclasses.dataclass
class Result:
    """One implementation (tcoll: one algorithm and buffer kind) at one size: all its repeats."""

    case: str
    impl: str
    algorithm: str
    buffers: str
    nbytes: int
    count: int
    dtype: str
    op: str
    n: int
    times: list[float]
    wrong: int | None = None
    error: str | None = None
    form: str = "call"

    @property
    def time(self) -> float | None:
        """The median time of one call over repeats, in seconds."""
        return statistics.median(self.times) if self.times else None

    @property
    def min_time(self) -> float | None:
        return min(self.times) if self.times else None

    @property
    def algbw(self) -> float | None:
        """Bytes of the size buffer per second of the median time, in GB/s."""
        t = self.time
        return self.nbytes / t / 1e9 if t and self.nbytes else None

    @property
    def busbw(self) -> float | None:
        """algbw times the collective's bus factor (nccl-tests), in GB/s; None for a copy-rate row (its algbw)."""
        algbw = self.algbw
        if algbw is None or self.impl == COPY:
            return None
        return algbw * CASES[self.case].busbw_factor(self.n)

    @property
    def variant(self) -> str:
        """How tcoll ran: the algorithm, with "/shm" for comm.empty buffers and "/plan" for a persistent plan."""
        return self.algorithm + ("/shm" if self.buffers == "shm" else "") + ("/plan" if self.form == "persistent" else "")

    def to_dict(self) -> dict[str, Any]:
        return dict(dataclasses.asdict(self), time=self.time, min_time=self.min_time, algbw=self.algbw,
                    busbw=self.busbw)


def aggregate(samples: Iterable[dict[str, Any]]) -> list[Result]:
    """Results from the samples of every repeat, in first-measured order; #wrong is the worst repeat."""
    found: dict[tuple[Any, ...], Result] = {}
    for s in samples:
        key = (s["case"], s["impl"], s["algorithm"], s["buffers"], s.get("form", "call"), s["nbytes"])
        result = found.get(key)
        if result is None:
            result = found[key] = Result(s["case"], s["impl"], s["algorithm"], s["buffers"], s["nbytes"],
                                         s["count"], s["dtype"], s["op"], s["n"], [], form=s.get("form", "call"))
        if s.get("time") is not None:
            result.times.append(s["time"])
        elif s.get("error") and result.error is None:
            result.error = s["error"]
        if s.get("wrong") is not None:
            result.wrong = max(result.wrong or 0, s["wrong"])
    return list(found.values())


# -- the table -------------------------------------------------------------------------------------


def _num(value: float | None, digits: int) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _ratio(tcoll: Result | None, theirs: Result | None) -> str:
    if tcoll is None or theirs is None or not tcoll.time or not theirs.time:
        return "-"
    return f"{theirs.time / tcoll.time:.2f}"


def _render(header: list[str], lines: list[list[str]], markdown: bool) -> str:
    if markdown:
        out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        return "\n".join(out + ["| " + " | ".join(cells) + " |" for cells in lines])
    widths = [max(len(h), *(len(c[i]) for c in lines)) if lines else len(h) for i, h in enumerate(header)]
    out = ["  ".join(h.rjust(w) for h, w in zip(header, widths))]
    return "\n".join(out + ["  ".join(c.rjust(w) for c, w in zip(cells, widths)) for cells in lines])


def format_table(results: list[Result], case: str, markdown: bool = False) -> str:
    """The table of one collective: a line per size (per tcoll variant, when several ran)."""
    mine = [r for r in results if r.case == case]
    variants = list(dict.fromkeys(r.variant for r in mine if r.impl == "tcoll"))
    others = list(dict.fromkeys(r.impl for r in mine if r.impl not in ("tcoll", COPY)))
    copies = {r.nbytes: r for r in mine if r.impl == COPY}
    sizes = list(dict.fromkeys(r.nbytes for r in mine))
    by_key = {(r.impl, r.variant if r.impl == "tcoll" else "", r.nbytes): r for r in mine}
    header = ["size (B)", "count", "dtype", "op"] + (["tcoll"] if len(variants) > 1 else [])
    header += ["time (us)", "algbw (GB/s)", "busbw (GB/s)", "#wrong"] + (["copy GB/s", "busbw/copy"] if copies else [])
    for impl in others:
        header += [f"{impl} (us)", f"{impl} busbw", f"tcoll/{impl}"]
    lines = []
    for nbytes in sizes:
        first = next(r for r in mine if r.nbytes == nbytes)
        for variant in variants or [""]:
            r = by_key.get(("tcoll", variant, nbytes))
            cells = [str(nbytes), str(first.count), first.dtype, first.op] + ([variant] if len(variants) > 1 else [])
            cells += [_num(r.time * 1e6, 1) if r and r.time else "-", _num(r.algbw if r else None, 3),
                      _num(r.busbw if r else None, 3), str(r.wrong) if r and r.wrong is not None else "-"]
            if copies:
                cells += _copy_cells(r, copies.get(nbytes))
            for impl in others:
                theirs = by_key.get((impl, "", nbytes))
                if theirs and theirs.wrong:  # a wrong result is not a time (a silent fallback must not look fast)
                    cells += ["WRONG", "-", "-"]
                    continue
                cells += [_num(theirs.time * 1e6, 1) if theirs and theirs.time else "-",
                          _num(theirs.busbw if theirs else None, 3), _ratio(r, theirs)]
            lines.append(cells)
    return _render(header, lines, markdown)


def _copy_cells(r: Result | None, copy: Result | None) -> list[str]:
    """The copy rate at a row's size and the row's busbw as a fraction of it."""
    rate = copy.algbw if copy else None
    busbw = r.busbw if r else None
    return [_num(rate, 3), _num(busbw / rate if busbw and rate else None, 2)]


def format_tables(results: list[Result], markdown: bool = False) -> str:
    """One table per collective, each under a title line when there are several."""
    cases = list(dict.fromkeys(r.case for r in results))
    if len(cases) == 1:
        return format_table(results, cases[0], markdown)
    parts = []
    for case in cases:
        n = next(r.n for r in results if r.case == case)
        title = f"#### {case} ({n} ranks)" if markdown else f"# {case} ({n} ranks)"
        parts.append(title + "\n" + format_table(results, case, markdown))
    return "\n\n".join(parts)


def write_json(path: str, header: dict[str, Any], results: list[Result], samples: list[dict[str, Any]]) -> None:
    """Every result (median, min, every repeat's time) and every raw sample."""
    with open(path, "w") as handle:
        json.dump({"header": header, "results": [r.to_dict() for r in results], "samples": samples}, handle,
                  indent=1)


# -- the plot --------------------------------------------------------------------------------------


class PlotUnavailable(RuntimeError):
    """matplotlib is not installed."""


def check_plot() -> None:
    """Raise PlotUnavailable (naming the extra to install) unless matplotlib can be imported."""
    import importlib.util

    if importlib.util.find_spec("matplotlib") is None:
        raise PlotUnavailable("--plot needs matplotlib, which is not installed: pip install tcoll[plot]")


def _us(r: Result) -> float:
    return (r.time or 0.0) * 1e6


def plot(results: list[Result], path: str) -> None:
    """busbw vs size and time vs size (log-log), a line per implementation and tcoll variant, per collective."""
    check_plot()
    import matplotlib  # type: ignore[import-not-found,unused-ignore]

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # type: ignore[import-not-found,unused-ignore]

    cases = list(dict.fromkeys(r.case for r in results))
    fig, axes = plt.subplots(len(cases), 2, figsize=(12, 4 * len(cases)), squeeze=False)
    for row, case in enumerate(cases):
        lines: dict[str, list[Result]] = {}
        for r in results:
            if r.case == case and r.time:
                lines.setdefault(f"tcoll {r.variant}" if r.impl == "tcoll" else r.impl, []).append(r)
        bw_ax, time_ax = axes[row]
        if case == "barrier":
            time_ax.bar(list(lines), [_us(rs[0]) for rs in lines.values()])
            time_ax.set_ylabel("time (us)")
            time_ax.tick_params(axis="x", labelrotation=30)
            bw_ax.set_axis_off()
            bw_ax.text(0.5, 0.5, "a barrier moves no data: see its time", ha="center", transform=bw_ax.transAxes)
        else:
            for label, rs in lines.items():
                style = "-" if label.startswith("tcoll") else "--"  # compare targets dashed
                rates = [r.algbw if r.impl == COPY else r.busbw for r in rs]  # a copy's rate: its algbw
                for ax, ys in ((bw_ax, rates), (time_ax, [_us(r) for r in rs])):
                    ax.loglog([r.nbytes for r in rs], ys, style, marker="o", label=label)
            bw_ax.set(xlabel="size (B)", ylabel="busbw (GB/s)")
            time_ax.set(xlabel="size (B)", ylabel="time (us)")
            bw_ax.legend(fontsize="small")
        n = next(r.n for r in results if r.case == case)
        bw_ax.set_title(f"{case}, {n} ranks: bus bandwidth")
        time_ax.set_title(f"{case}, {n} ranks: time per call")
        for ax in (bw_ax, time_ax):
            ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# -- progress --------------------------------------------------------------------------------------


class _Watch:
    """Counts the dots rank 0 appends to a file, one per measurement, while a sweep runs."""

    def __init__(self, progress: Progress, path: str, names: list[str] | None = None) -> None:
        self.progress = progress
        self.path = path
        self.names = names or []  # what each measurement is, in order: "all_reduce 64 MiB"
        self.seen = 0
        self.closed = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()

    def _count(self) -> int:
        try:
            return os.path.getsize(self.path)
        except OSError:
            return 0

    def _poll(self) -> None:
        while not self._stop.wait(0.2):
            count = self._count()
            if count < len(self.names):
                self.progress.current = self.names[count]
            self.progress.draw(self.progress.done + count)

    def close(self) -> int:
        """Stop watching; returns the measurements seen (counted into the progress once)."""
        if not self.closed:
            self.closed = True
            self._stop.set()
            self._thread.join()
            self.seen = self._count()
            self.progress.done += self.seen
            self.progress.draw(self.progress.done)
        return self.seen


class Progress:
    """A one-line progress bar on a TTY; elsewhere only a final line."""

    def __init__(self, stream: TextIO | None = None, tty: bool | None = None) -> None:
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty() if tty is None else tty
        self.total = 0
        self.done = 0
        self.label = ""
        self.current = ""  # the measurement running now, when the watch knows it
        self.started = time.monotonic()
        self._lock = threading.Lock()

    def start(self, total: int) -> None:
        self.total, self.done, self.started = total, 0, time.monotonic()

    def watch(self, path: str, label: str, names: list[str] | None = None) -> _Watch:
        """Follow the progress file of one sweep (labelled e.g. "gloo 2/3"; `names`: its measurements in order)."""
        self.label = label
        self.current = ""
        return _Watch(self, path, names)

    def drop(self, count: int) -> None:
        """Measurements that will not happen after all (a compare target failed)."""
        self.total = max(self.done, self.total - max(count, 0))

    def draw(self, done: int) -> None:
        if not self.tty or not self.total:
            return
        done = min(done, self.total)
        elapsed = time.monotonic() - self.started
        eta = f"{elapsed / done * (self.total - done):.0f}s" if done else "?"
        filled = int(30 * done / self.total)
        what = f"{self.current} on {self.label}" if self.current else self.label
        line = f"\r[{'#' * filled}{'.' * (30 - filled)}] {done}/{self.total} {what}  {elapsed:.0f}s, eta {eta} "
        with self._lock:
            self.stream.write(line)
            self.stream.flush()

    def close(self) -> None:
        """End the bar with one summary line."""
        elapsed = time.monotonic() - self.started
        with self._lock:
            if self.tty:
                self.stream.write("\r" + " " * 79 + "\r")
            self.stream.write(f"# {self.done} measurements in {elapsed:.1f} s\n")
            self.stream.flush()
