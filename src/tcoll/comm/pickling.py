"""How a Python object travels between ranks: its pickle (protocol 5) in parts, each sent from its own memory.

An object travels as its pickle (protocol 5) in parts: the pickle stream,
then each large out-of-band buffer (a NumPy array's data, ...) as a message
of its own, sent straight from the object's memory: no concatenation copy
and no limit on a part's size, so a multi-GiB array inside an object moves
like an array. Buffers under 64 KiB stay in the stream (fewer messages).
The receiver allocates each part and unpickles with `buffers=`; arrays in
the result share memory with those parts (no further copy).

The sizes travel first, in a fixed-size record of int64 (the number of
parts and up to seven sizes; more sizes follow in one extra message), then
the parts. A rank that cannot pickle its object still takes part, sending
a record that says so.
"""

from __future__ import annotations

import pickle
from typing import Any

import numpy as np

from ..algos.team import Algorithm, Team
from ..errors import TcollError, known_to_peers
from ..p2p.work import Work

__all__ = ["INLINE_BYTES", "Parts", "dump", "load", "copy_load", "size_record", "overflow_for", "allocate",
           "exchange_parts", "check_failed", "try_dump", "FAILED", "SLOTS"]

INLINE_BYTES = 1 << 16  # out-of-band buffers smaller than this are pickled in-band
SLOTS = 7  # part sizes a record holds; the rest travel in an overflow message
FAILED = -1  # a record's part count when the sender could not pickle its object

Parts = list[np.ndarray]  # the pickle stream, then the out-of-band buffers: flat uint8 views


def dump(obj: Any) -> Parts:
    """Pickle `obj` (protocol 5) into parts: the stream, then its large out-of-band buffers (not copied)."""
    buffers: Parts = []

    def out_of_band(buf: pickle.PickleBuffer) -> bool:
        try:
            raw = buf.raw()
        except BufferError:  # not contiguous: let pickle copy it in-band
            return True
        if raw.nbytes < INLINE_BYTES:
            return True
        buffers.append(np.asarray(raw))
        return False

    stream = pickle.dumps(obj, protocol=5, buffer_callback=out_of_band)
    return [np.frombuffer(stream, dtype=np.uint8), *buffers]


def load(parts: Parts) -> Any:
    """Unpickle what `dump` made (arrays in the result share memory with the buffer parts)."""
    return pickle.loads(parts[0].data, buffers=parts[1:])


def copy_load(parts: Parts) -> Any:
    """Unpickle this rank's own parts into an independent copy."""
    return pickle.loads(parts[0].data, buffers=[part.copy() for part in parts[1:]])


def size_record(parts: Parts | None) -> tuple[np.ndarray, np.ndarray]:
    """The fixed-size size record of `parts` (None: pickling failed) and the overflow sizes."""
    record = np.zeros(SLOTS + 1, dtype=np.int64)
    if parts is None:
        record[0] = FAILED
        return record, np.empty(0, dtype=np.int64)
    sizes = [part.nbytes for part in parts]
    record[0] = len(sizes)
    record[1:1 + min(len(sizes), SLOTS)] = sizes[:SLOTS]
    return record, np.array(sizes[SLOTS:], dtype=np.int64)


def overflow_for(record: np.ndarray) -> np.ndarray:
    """A buffer for the overflow sizes that `record` announces."""
    return np.empty(max(0, int(record[0]) - SLOTS), dtype=np.int64)


def allocate(record: np.ndarray, overflow: np.ndarray) -> Parts | None:
    """Receive buffers for the parts that `record` and `overflow` describe (None: the sender failed)."""
    if record[0] == FAILED:
        return None
    sizes = [int(n) for n in record[1:1 + min(int(record[0]), SLOTS)]] + [int(n) for n in overflow]
    return [np.empty(n, dtype=np.uint8) for n in sizes]


def send_parts(team: Team, parts: Parts | None, peer: int) -> list[Work]:
    """Send the record, the overflow sizes and the parts to `peer`, in that order, on one stream."""
    record, overflow = size_record(parts)
    works = [team.send(record, peer)]
    if overflow.size:
        works.append(team.send(overflow, peer))
    return works + [team.send(part, peer) for part in parts or ()]


def exchange_parts(team: Team, outgoing: dict[int, Parts | None], sources: list[int]) -> Algorithm:
    """Send each peer its parts and receive parts from each source, straight from and into memory.

    Returns {source: its parts, or None if it could not pickle}.
    """
    sends = [work for peer, parts in outgoing.items() for work in send_parts(team, parts, peer)]
    records = {src: np.empty(SLOTS + 1, dtype=np.int64) for src in sources}
    yield [team.recv(record, src) for src, record in records.items()]
    overflows = {src: overflow_for(record) for src, record in records.items()}
    more = [team.recv(overflow, src) for src, overflow in overflows.items() if overflow.size]
    if more:
        yield more
    received = {src: allocate(records[src], overflows[src]) for src in sources}
    yield sends + [team.recv(part, src) for src, parts in received.items() for part in parts or ()]
    return received


def check_failed(what: str, received: dict[int, Parts | None]) -> None:
    failed = sorted(src for src, parts in received.items() if parts is None)
    if failed:
        raise known_to_peers(TcollError(f"{what}: rank {failed[0]} could not pickle its object"))


def try_dump(obj: Any) -> tuple[Parts | None, BaseException | None]:
    """dump(obj), or (None, the error) when it cannot be pickled."""
    try:
        return dump(obj), None
    except Exception as exc:  # noqa: BLE001 - pickling can raise almost anything; it is re-raised later
        return None, exc


