"""The ring kernel writes the wire format of tcoll.p2p.channel: compared at import, a difference refuses to load."""

from __future__ import annotations

import pytest

from tcoll.p2p.channel import HEADER, MAGIC
from tcoll.transport.shm import rings as shm

kernel = pytest.importorskip("tcoll.transport.shm._ring_kernel")


def test_the_built_kernel_matches() -> None:
    shm.check_ring_kernel(kernel)  # what the import did
    assert kernel.MAGIC == MAGIC and kernel.HEADER_BYTES == HEADER.size


def test_a_wire_format_changed_in_python_only_refuses_the_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(shm, "MAGIC", MAGIC + 1)  # as if channel.py moved to a version 3 alone
    with pytest.raises(ImportError, match=r"MAGIC is \d+ in C but \d+ in tcoll.p2p.channel.*Rebuild"):
        shm.check_ring_kernel(kernel)


def test_a_header_size_changed_in_c_only_refuses_the_kernel() -> None:
    class Edited:  # the kernel as if its C side wrote 48-byte headers
        __name__, __file__ = kernel.__name__, kernel.__file__
        MAGIC, HEADER_BYTES = kernel.MAGIC, 48

    with pytest.raises(ImportError, match="HEADER_BYTES is 48 in C but 40"):
        shm.check_ring_kernel(Edited)
