"""Copy speed between shared memory and a private array, by the array's offset in its page.

    python benchmarks/copy_offsets.py                  # 64 KiB, 1 MiB, 16 MiB, 64 MiB
    python benchmarks/copy_offsets.py --sizes 1M --markdown

An arena slot starts on a page; a large NumPy array starts 16 bytes into one (malloc's header). On some
CPUs glibc's memcpy (which NumPy's copies use) is several times slower for some distances between
destination and source modulo 4096 (`rep movsb` on AMD Zen when the destination sits just after the
source). tcoll copies with its own vector loop (src/tcoll/_native/copy.h), whose direction in the
aliasing window was calibrated when the module loaded. Each row: GB/s of a copy of SIZE bytes,
slot -> array and array -> slot, with the array at that page offset, for NumPy (glibc), tcoll's copy as
calibrated, and tcoll's copy forced forwards and backwards in the window. The last lines give, per size
and copy, the slowest offset as a fraction of the fastest: a robust copy shows about 1.0.
"""

from __future__ import annotations

import argparse
import mmap
import os
import sys
import time

import numpy as np

from tcoll.bench.machine import describe_machine

OFFSETS = (0, 16, 32, 48, 64, 512, 2048, 4032, 4048, 4064, 4080)


def rate(copy, nbytes: int, iters: int) -> float:
    """GB/s of `copy()` (best of 3 rounds of `iters` calls, after 3 warm-up calls)."""
    for _ in range(3):
        copy()
    best = 0.0
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(iters):
            copy()
        best = max(best, nbytes * iters / (time.perf_counter() - start) / 1e9)
    return best


def copies() -> dict:
    """The copies to compare: NumPy's, and tcoll's as calibrated and forced each way (if built)."""
    ways = {"numpy": np.copyto}
    try:
        from tcoll.shm import _arena_kernel as kernel
    except ImportError:
        return ways
    ways["tcoll"] = kernel.copy
    ways["tcoll fwd"] = lambda dst, src: kernel.copy(dst, src, False)
    ways["tcoll back"] = lambda dst, src: kernel.copy(dst, src, True)
    return ways


def parse_size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(text[:-1]) * units[text[-1].upper()] if text[-1].upper() in units else int(text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="64K,1M,16M,64M", help="comma-separated sizes (default %(default)s)")
    parser.add_argument("--markdown", action="store_true", help="print Markdown tables")
    args = parser.parse_args(argv)
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    fd = os.memfd_create("copy-offsets")
    os.ftruncate(fd, max(sizes))
    slot = np.frombuffer(mmap.mmap(fd, max(sizes)), np.uint8)
    slot[:] = 1
    big = np.ones(max(sizes) + 8192, np.uint8)
    ways = copies()
    print(f"# machine: {describe_machine()}")
    try:
        from tcoll.shm import _arena_kernel as kernel
        forward, backward = kernel.COPY_CALIBRATION
        print(f"# tcoll's calibration: 256 KiB at distance 16 took {forward / 1e3:.1f} us forwards, "
              f"{backward / 1e3:.1f} us backwards: copies {'backwards' if kernel.COPY_BACKWARDS else 'forwards'}")
    except ImportError:
        print("# tcoll's copy kernel is not built: NumPy only")
    worst: dict[tuple[str, int], list[float]] = {}
    for size in sizes:
        iters = max(5, (256 << 20) // size)
        head = " | ".join(f"{name} s->a / a->s" for name in ways)
        print(f"\n{size >> 10} KiB, GB/s by the array's page offset\n")
        print(f"| offset | {head} |" if args.markdown else f"offset  {head}")
        if args.markdown:
            print("|---|" + "---|" * len(ways))
        for off in OFFSETS:
            at = (-big.ctypes.data) % 4096 + off
            arr = big[at:at + size]
            cells = []
            for name, copy in ways.items():
                out = rate(lambda: copy(arr, slot[:size]), size, iters)
                into = rate(lambda: copy(slot[:size], arr), size, iters)
                cells.append(f"{out:5.1f} / {into:5.1f}")
                w = worst.setdefault((name, size), [1e9, 0.0])
                w[0], w[1] = min(w[0], out, into), max(w[1], out, into)
            print(f"| {off} | " + " | ".join(cells) + " |" if args.markdown else f"{off:6d}  " + "   ".join(cells))
    print("\nslowest / fastest offset:")
    for (name, size), (lo, hi) in worst.items():
        print(f"  {name:10s} {size >> 10:6d} KiB  {lo / hi:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
