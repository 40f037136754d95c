"""The arena's slot: 1 MiB by default, 2 MiB where the host's ranks outnumber its cores, as rank 0 sizes it (and
the pieces of large reductions with it); the choices every rank makes rest on a size they all compute alike."""

from __future__ import annotations

import pytest

import tcoll
from tcoll.env import Settings
from tcoll.p2p.waiting import SpinPolicy
from tcoll.shm.address import PIECE_BYTES, SLOT_BYTES, SLOT_BYTES_SHARED, agreed_piece, agreed_slot


def test_the_default_slot_is_larger_where_ranks_outnumber_cores() -> None:
    assert agreed_slot(-1, 4) == SLOT_BYTES == 1 << 20
    assert agreed_slot(-1, 4, oversubscribed=True) == SLOT_BYTES_SHARED == 2 << 20
    assert agreed_slot(4096, 4, oversubscribed=True) == 4096  # TCOLL_SHM_SLOT rules
    assert agreed_slot(64, 8) == 512  # at least 64 bytes a rank


def _slots_seen(comm: tcoll.Communicator) -> list[int]:
    """The slot the rank's choices rest on, as it counts the host's cores both ways."""
    engine, chooser = comm.core.engine, comm.core.dispatch.chooser
    seen = []
    for oversubscribed in (False, True):
        engine.spin = SpinPolicy(engine.settings.spin_us, oversubscribed=oversubscribed)
        seen.append(chooser.slot_bytes())
    return seen


def test_choices_rest_on_a_slot_that_does_not_depend_on_counting_cores() -> None:
    assert tcoll.spawn(_slots_seen, 1, threads=True, timeout=30) == [[SLOT_BYTES, SLOT_BYTES]]


def test_auto_in_the_environment_is_the_default_and_nonsense_is_named() -> None:
    for text in ("auto", "AUTO", "-1"):
        found = Settings.from_env({"TCOLL_SHM_SLOT": text, "TCOLL_SHM_ONE_STEP": text})
        assert (found.shm_slot, found.shm_one_step) == (-1, -1)
    assert Settings.from_env({"TCOLL_SHM_SLOT": "256K"}).shm_slot == 256 << 10
    with pytest.raises(ValueError, match="TCOLL_SHM_SLOT='-2'"):
        Settings.from_env({"TCOLL_SHM_SLOT": "-2"})


def test_large_reductions_go_in_quarter_slot_pieces_unless_ranks_share_cores() -> None:
    assert agreed_piece(SLOT_BYTES) == PIECE_BYTES == 256 << 10
    assert agreed_piece(64 << 10) == 64 << 10  # never more than a slot
    assert agreed_piece(SLOT_BYTES_SHARED, oversubscribed=True) == SLOT_BYTES_SHARED
