"""The text of `tcoll.explain` and `tcoll explain`: the ranked algorithms, their traffic, and why one wins."""

from __future__ import annotations

from .registry import AlgorithmInfo, Costs
from .traffic import traffic

__all__ = ["describe_choice", "format_bytes", "format_seconds"]


def format_bytes(nbytes: float) -> str:
    """1536 -> "1.5 KiB", 64 << 20 -> "64 MiB", 8 -> "8 B"."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.4g} {unit}"
    return f"{nbytes:.0f} B"


def format_seconds(seconds: float) -> str:
    """2.5e-6 -> "2.5 us", 0.0345 -> "34.5 ms"."""
    for unit, scale in (("s", 1.0), ("ms", 1e-3)):
        if seconds >= scale:
            return f"{seconds / scale:.1f} {unit}"
    return f"{seconds * 1e6:.1f} us"


def _why(options: list[tuple[float, AlgorithmInfo]], costs: Costs, nbytes: int, size: int) -> str:
    """One line on why the first option wins."""
    seconds, best = options[0]
    if size == 1:
        return "why: a single rank sends nothing; every algorithm returns at once."
    if best.direct:
        return (f"why: a blocking call with every rank on one host: {best.name} replaces each message "
                "with a flag in shared memory and copies each byte once in and once out.")
    if len(options) == 1:
        return f"why: {best.name} is the only algorithm that can run this call."
    runner_time, runner = options[1]
    if best.hierarchical or runner.hierarchical:  # priced per link, step by step (shown below the table)
        share = f"{seconds / runner_time:.0%} of the time" if runner_time else "the time"
        return (f"why: {best.name} takes {share} of the next best, {runner.name}, with the network "
                "and shared memory each priced for the steps that use them.")
    latency = [info.cost(Costs(costs.alpha, 0.0, 0.0), nbytes, size) for info in (best, runner)]
    volume = [total - lat for total, lat in zip((seconds, runner_time), latency)]
    mine = traffic(best.collective, best.name, nbytes, size)
    theirs = traffic(runner.collective, runner.name, nbytes, size)
    if latency[1] - latency[0] >= volume[1] - volume[0]:
        detail = (f"fewer message latencies in a row ({latency[0] / costs.alpha:.0f} against "
                  f"{latency[1] / costs.alpha:.0f})")
    else:
        detail = "fewer bytes moved and reduced"
        if mine and theirs and mine.bytes != theirs.bytes:
            detail += f" ({format_bytes(mine.bytes)} sent per rank against {format_bytes(theirs.bytes)})"
    share = f"{seconds / runner_time:.0%} of the time" if runner_time else "the time"
    return f"why: {best.name} takes {share} of the next best, {runner.name}, mostly through {detail}."


def describe_choice(collective: str, nbytes: int, size: int, transport: str, costs: Costs,
                    options: list[tuple[float, AlgorithmInfo]], hosts: int = 1) -> str:
    """The explain table for `options` (cheapest first, as `select.ranked` returns them).

    Raises:
        ValueError: no option (no algorithm can run the call).
    """
    if not options:
        raise ValueError(f"no {collective} algorithm supports this call")
    where = f"{size} rank{'s' if size != 1 else ''} over {transport}" + (f" on {hosts} hosts" if hosts > 1 else "")
    lines = [f"{collective}, {format_bytes(nbytes)} per rank, {where} "
             f"(alpha {costs.alpha * 1e6:g} us, beta {1 / costs.beta / 1e9:g} GB/s, "
             f"gamma {1 / costs.gamma / 1e9:g} GB/s):",
             f"   {'algorithm':<20} {'time':>10} {'msgs/rank':>10} {'bytes/rank':>11}"]
    for index, (seconds, info) in enumerate(options):
        mark = "*" if index == 0 else " "
        sent = traffic(collective, info.name, nbytes, size)
        msgs, volume = ("-", "-") if sent is None else (str(sent.messages), format_bytes(sent.bytes))
        lines.append(f" {mark} {info.name:<20} {format_seconds(seconds):>10} {msgs:>10} {volume:>11}  "
                     f"{info.summary}")
    lines.append(_why(options, costs, nbytes, size))
    return "\n".join(lines)
