"""Where an arena lives: rank 0 creates its segment and broadcasts an address, the others open it.

The address is the one message that makes an arena common to its ranks: rank 0's slot size, one-step limit
and piece size travel with it, so every rank lays out and steps the arena alike whatever its own settings.
"""

from __future__ import annotations

import secrets

import numpy as np

from ..errors import TransportError
from ..segments import Segment, new_segment, segment_name
from .arena import arena_bytes

__all__ = ["ADDRESS_BYTES", "PIECE_BYTES", "agreed_slot", "agreed_piece", "create_segment", "open_segment",
           "encode_address", "decode_address"]

# An arena's address as rank 0 broadcasts it:
# "<slot>:<one-step limit>:<piece>:<single copies 0/1>:<path>:<memfd name>".
ADDRESS_BYTES = 256
_HINT = "a smaller TCOLL_SHM_SLOT or a larger /dev/shm may help"


SLOT_BYTES = 1 << 20  # an arena slot by default (TCOLL_SHM_SLOT)
# ... when the host's ranks outnumber its cores: every step's synchronisation may wait for a rank to be
# scheduled, so fewer, larger pieces win (4 and 8 ranks on 2 cores, 2-32 MiB all_reduce: 5-19% faster than
# with 1 MiB; 2 ranks with a core each were slower with 2 MiB: docs/performance.md)
SLOT_BYTES_SHARED = 2 << 20


def agreed_slot(setting: int, size: int, oversubscribed: bool = False) -> int:
    """The slot size rank 0 chooses from its setting (every rank then uses rank 0's).

    Args:
        setting: TCOLL_SHM_SLOT in bytes; -1: the default (SLOT_BYTES, or SLOT_BYTES_SHARED where
            the host's ranks outnumber its cores).
    """
    if setting < 0:
        setting = SLOT_BYTES_SHARED if oversubscribed else SLOT_BYTES
    return max(64 * size, (setting + 63) & ~63)


# The pieces of an all_reduce/reduce larger than a slot, where every rank has a core of its own: the C kernel's
# loop (pieces.h) copies in, reduces and copies out each piece while it is in cache. 2 ranks on the 2-core
# Xeon, µs per call with 128 KiB / 256 KiB / 512 KiB / 1 MiB pieces: 2 MiB 275 / 280 / 302 / 310, 8 MiB
# 1086 / 1094 / 1070 / 1157 (docs/performance.md). Where ranks share cores, every piece's synchronisation may
# wait for a rank to be scheduled, and slot-sized pieces won (4 ranks on 2 cores, 4 MiB: 2094 us with 256 KiB
# pieces, 1712 with 2 MiB).
PIECE_BYTES = 256 << 10


def agreed_piece(slot: int, oversubscribed: bool = False) -> int:
    """The bytes of a large all_reduce's pieces that rank 0 chooses for an arena of `slot`-byte slots (every rank
    then uses rank 0's): PIECE_BYTES, or the whole slot where the host's ranks outnumber its cores."""
    return slot if oversubscribed else min(slot, PIECE_BYTES)


def create_segment(run_id: str, world_rank: int, size: int, slot: int, anonymous: bool = True) -> Segment:
    """Create the segment of a new arena (rank 0 does, then tells the others its address).

    Args:
        anonymous: a memfd (every rank of the host sees rank 0's pid), else a file in /dev/shm.

    Raises:
        TransportError: no room in memory or /dev/shm.
    """
    name = segment_name(run_id, world_rank, "arena" + secrets.token_hex(6))
    return new_segment(name, arena_bytes(size, slot), anonymous=anonymous, hint=_HINT)


def open_segment(path: str, name: str | None) -> Segment:
    """Map the segment of an arena that rank 0 created (`name`: its memfd's name, None for a file).

    Raises:
        TransportError: it cannot be mapped, or its /proc path no longer holds that memfd.
    """
    return Segment.open(path, name)


SINGLE_COPY_MODES = ("off", "on", "auto")  # TCOLL_SHM_SINGLE_COPY, as rank 0 sends it (its index)


def encode_address(slot: int, one_step: int, piece: int, segment: Segment, single_copy: str = "off") -> np.ndarray:
    """The ADDRESS_BYTES rank 0 broadcasts: slot size, one-step limit, piece size, its single-copy setting
    (SINGLE_COPY_MODES), path and memfd name of `segment` (all zero: it failed). Every rank takes rank 0's
    slot, limit, piece and setting, so the ranks' settings cannot disagree on them."""
    out = np.zeros(ADDRESS_BYTES, dtype=np.uint8)
    mode = SINGLE_COPY_MODES.index(single_copy)
    encoded = f"{slot}:{one_step}:{piece}:{mode}:{segment.path}:{segment.name or ''}".encode()
    if len(encoded) > ADDRESS_BYTES:
        raise TransportError(f"the arena's address {encoded!r} exceeds {ADDRESS_BYTES} bytes")
    out[:len(encoded)] = np.frombuffer(encoded, dtype=np.uint8)
    return out


def decode_address(address: np.ndarray) -> tuple[int, int, int, str, str, str | None] | None:
    """(slot, one-step limit, piece, single-copy setting, path, memfd name or None) from what encode_address
    made, or None if rank 0 could not create it."""
    text = bytes(address).rstrip(b"\0").decode()
    if not text:
        return None
    slot, one_step, piece, single, path, name = text.split(":")  # names and paths are made of run ids: no ':'
    return int(slot), int(one_step), int(piece), SINGLE_COPY_MODES[int(single)], path, name or None
