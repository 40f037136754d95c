"""What each point-to-point algorithm puts on the wire: messages and bytes of its busiest rank.

The counterpart of the time formulas each algorithm registers (tcoll.algos.select
weighs those): here, the messages and the bytes that the rank sending most
sends, in closed form, so `tcoll explain` shows them at any world size. They
are exact when the data divides evenly into the algorithm's blocks (the
recorder's tests, tests/algos/test_record.py, check them against the recorded
schedules of world sizes 1 to 64) and close otherwise. The direct (shared
memory) algorithms send no messages and have no entry.

Notation: n is the cost model's nbytes (one rank's input: the whole vector for
all_reduce, reduce and broadcast, one block for all_gather, gather and scatter,
the whole send buffer for reduce_scatter and all_to_all), p the ranks, q the
largest power of two <= p, l = log2 q, L = ceil(log2 p), and a pipelined block
of b bytes is cut into ceil(b / chunk) messages.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

from .topology import pof2_below

__all__ = ["Traffic", "traffic", "FORMULAS"]


class Traffic(NamedTuple):
    """The busiest rank's share of one call: most messages any rank sends, most bytes any rank sends."""

    messages: int
    bytes: int


def _chunks(block: float, chunk: int) -> int:
    """Messages a pipelined block of `block` bytes takes (one even when empty)."""
    return max(1, math.ceil(block / chunk))


def _ceil_log2(p: int) -> int:
    return (p - 1).bit_length()


def _ones_below(p: int) -> int:
    """The number of one bits in all of 0, 1, ..., p-1 (Bruck's all-to-all sends a block per one bit)."""
    total, bit = 0, 1
    while bit < p:
        total += (p >> 1) // bit * bit + max(0, p % (2 * bit) - bit)
        bit <<= 1
    return total


def _doubling_gather_blocks(p: int) -> int:
    """Blocks rank 0 sends in a folded recursive-doubling all-gather: its growing range, with doubled ranks."""
    q, extra = pof2_below(p), p - pof2_below(p)
    total, width = 0, 1
    while width < q:
        total += width + min(width, extra)  # newranks below `extra` hold two blocks
        width <<= 1
    return total


def _largest_subtree(p: int) -> int:
    """Ranks in the biggest subtree below the root of a binomial tree of p ranks."""
    top = 1 << (_ceil_log2(p) - 1)
    return max(top // 2, min(top, p - top))


Formula = Callable[[int, int, int], Traffic]  # (n, p, chunk) -> Traffic


def _fold(p: int) -> int:
    return int(p != pof2_below(p))


FORMULAS: dict[tuple[str, str], Formula] = {
    ("all_reduce", "naive"): lambda n, p, c: Traffic(p - 1, (p - 1) * n),
    ("all_reduce", "ring"): lambda n, p, c: Traffic(2 * (p - 1) * _chunks(n / p, c), 2 * (p - 1) * n // p),
    ("all_reduce", "recursive_doubling"): lambda n, p, c: Traffic(
        pof2_below(p).bit_length() - 1 + _fold(p), (pof2_below(p).bit_length() - 1 + _fold(p)) * n),
    ("all_reduce", "rabenseifner"): lambda n, p, c: Traffic(
        2 * (pof2_below(p).bit_length() - 1) + _fold(p),
        2 * n * (pof2_below(p) - 1) // pof2_below(p) + _fold(p) * n),
    ("all_reduce", "binomial"): lambda n, p, c: Traffic(_ceil_log2(p), _ceil_log2(p) * n),
    ("reduce", "binomial"): lambda n, p, c: Traffic(min(1, p - 1), min(1, p - 1) * n),
    ("reduce", "reduce_scatter_gather"): lambda n, p, c: Traffic(
        pof2_below(p).bit_length() - 1 + min(1, p - 1),
        max(n * (pof2_below(p) - 1) // pof2_below(p) + n // 2 * min(1, pof2_below(p) - 1), _fold(p) * n)),
    ("broadcast", "binomial"): lambda n, p, c: Traffic(_ceil_log2(p), _ceil_log2(p) * n),
    ("broadcast", "scatter_allgather"): lambda n, p, c: Traffic(
        _ceil_log2(p) + (p - 1) * _chunks(n / p, c) if p > 1 else 0, 2 * (p - 1) * n // p),
    ("broadcast", "chain"): lambda n, p, c: Traffic(_chunks(n, c) if p > 1 else 0, n if p > 1 else 0),
    ("all_gather", "ring"): lambda n, p, c: Traffic((p - 1) * _chunks(n, c), (p - 1) * n),
    ("all_gather", "recursive_doubling"): lambda n, p, c: Traffic(
        pof2_below(p).bit_length() - 1 + _fold(p), (_doubling_gather_blocks(p) + _fold(p) * p) * n),
    ("all_gather", "bruck"): lambda n, p, c: Traffic(_ceil_log2(p), (p - 1) * n),
    ("gather", "linear"): lambda n, p, c: Traffic(min(1, p - 1), min(1, p - 1) * n),
    ("gather", "binomial"): lambda n, p, c: Traffic(min(1, p - 1), _largest_subtree(p) * n if p > 1 else 0),
    ("scatter", "linear"): lambda n, p, c: Traffic(p - 1, (p - 1) * n),
    ("scatter", "binomial"): lambda n, p, c: Traffic(_ceil_log2(p), (p - 1) * n),
    ("reduce_scatter", "ring"): lambda n, p, c: Traffic((p - 1) * _chunks(n / p, c), (p - 1) * n // p),
    ("reduce_scatter", "recursive_halving"): lambda n, p, c: Traffic(
        pof2_below(p).bit_length() - 1 + _fold(p), n if _fold(p) else n * (p - 1) // p),
    ("reduce_scatter", "pairwise"): lambda n, p, c: Traffic(p - 1, (p - 1) * n // p),
    ("all_to_all", "pairwise"): lambda n, p, c: Traffic(p - 1, (p - 1) * n // p),
    ("all_to_all", "bruck"): lambda n, p, c: Traffic(_ceil_log2(p), _ones_below(p) * n // p),
    ("scan", "linear"): lambda n, p, c: Traffic(_chunks(n, c), n),
    ("scan", "recursive_doubling"): lambda n, p, c: Traffic(_ceil_log2(p), _ceil_log2(p) * n),
    ("exscan", "linear"): lambda n, p, c: Traffic(_chunks(n, c), n),
    ("exscan", "recursive_doubling"): lambda n, p, c: Traffic(_ceil_log2(p), _ceil_log2(p) * n),
    ("barrier", "dissemination"): lambda n, p, c: Traffic(_ceil_log2(p), 0),
    ("barrier", "tree"): lambda n, p, c: Traffic(_ceil_log2(p), 0),
}


def traffic(collective: str, algorithm: str, nbytes: int, size: int, chunk_bytes: int = 1 << 20) -> Traffic | None:
    """The busiest rank's messages and bytes for one call, or None for a direct (shared-memory) algorithm.

    Args:
        collective, algorithm: what runs.
        nbytes: one rank's input, as the cost model counts it (see the module docstring).
        size: ranks.
        chunk_bytes: bytes per message of the pipelined algorithms (TCOLL_COLL_CHUNK).
    """
    formula = FORMULAS.get((collective, algorithm))
    if formula is None:
        return None
    if size == 1:
        return Traffic(0, 0)
    return formula(nbytes, size, chunk_bytes)
