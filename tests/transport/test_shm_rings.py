"""The byte rings of the shm transport, on their own: copies that wrap, headers cut by the wrap, ring sizes.

A ring is a byte stream over a fixed buffer: stream position p lies at byte
p % size. These tests write and read streams through the module's own
copy functions on an anonymous mapping, so every wrap-around case (small
copies through memoryview, large ones through NumPy, a header split in two)
is checked against the bytes that went in.
"""

from __future__ import annotations

import mmap

import numpy as np
import pytest

from tcoll.p2p.channel import HEADER, MAGIC, pack_header, unpack_header
from tcoll.transport.shm import rings

SIZE = 8192


@pytest.fixture(name="ring")
def ring_fixture() -> rings.Ring:
    buf = mmap.mmap(-1, rings.RING_CTL + SIZE)
    ring = rings.Ring(buf, 0, SIZE)
    yield ring
    ring.release()


def _stream(n: int, seed: int) -> np.ndarray:
    return ((np.arange(n, dtype=np.int64) * 31 + seed) % 253).astype(np.uint8)


@pytest.mark.parametrize("start", [0, 1, SIZE - 1, SIZE - 100, SIZE - 5000, 3 * SIZE + 17])
@pytest.mark.parametrize("count", [1, 100, rings._SMALL - 1, rings._SMALL, SIZE // 2, SIZE])
def test_write_then_read_gives_the_bytes_back(ring: rings.Ring, start: int, count: int) -> None:
    data = _stream(count, start)
    rings.write(ring, start, data, 0, count)
    out = np.zeros(count + 10, dtype=np.uint8)
    rings.read(ring, start, out, 5, count)
    np.testing.assert_array_equal(out[5:5 + count], data)
    assert not out[:5].any() and not out[5 + count:].any()  # nothing written outside the target


def test_a_write_wraps_at_the_end_of_the_buffer(ring: rings.Ring) -> None:
    data = _stream(300, 1)
    rings.write(ring, SIZE - 100, data, 0, 300)
    np.testing.assert_array_equal(ring.np[SIZE - 100:], data[:100])
    np.testing.assert_array_equal(ring.np[:200], data[100:])


def test_a_write_takes_a_slice_of_its_source(ring: rings.Ring) -> None:
    data = _stream(1000, 2)
    rings.write(ring, 10, data, 400, 250)
    np.testing.assert_array_equal(ring.np[10:260], data[400:650])


@pytest.mark.parametrize("offset_from_end", [HEADER.size, HEADER.size - 1, 1, 16])
def test_a_header_cut_by_the_wrap_reads_whole(ring: rings.Ring, offset_from_end: int) -> None:
    position = 5 * SIZE - offset_from_end
    stamp = 42 | 7 << 64 | 1 << 127  # both words of the stamp travel
    rings.write(ring, position, pack_header(7, 123456789, 4096, stamp))
    assert unpack_header(rings.read_header(ring, position), peer=1) == (7, 123456789, 4096, stamp)


def test_a_corrupt_header_is_a_transport_error(ring: rings.Ring) -> None:
    from tcoll.errors import TransportError

    rings.write(ring, 0, b"\xff" * HEADER.size)
    with pytest.raises(TransportError, match="corrupt message header from rank 3"):
        unpack_header(rings.read_header(ring, 0), peer=3)
    assert MAGIC == HEADER.unpack(pack_header(0, 0, 0))[0]


@pytest.mark.parametrize("setting,nlocal,expected", [
    (0, 2, 4 << 20),             # two ranks: the ceiling
    (0, 16, 1_118_208),          # 240 pairs share the 256 MiB budget (in whole pages)
    (0, 64, 256 << 10),          # the floor
    (10_000, 8, 12_288),         # a setting rounds up to pages
    (8192, 2, 8192),
])
def test_ring_sizes(setting: int, nlocal: int, expected: int) -> None:
    size = rings.ring_bytes(setting, nlocal)
    assert size == expected and size % 4096 == 0
