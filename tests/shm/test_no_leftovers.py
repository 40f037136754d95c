"""kill -9 leaves nothing of the job in /dev/shm, without `tcoll run` or `tcoll.spawn` to sweep after it."""

from __future__ import annotations

import gc
import os
import signal
import textwrap
from pathlib import Path

import numpy as np
import pytest
from helpers.procs import run_ranks, shm_segments

from tcoll.errors import TransportError


# Both ranks lend zero-copy buffers to a direct all_reduce (so each maps the other's), then die by SIGKILL.
_JOB = """
    import os, signal, sys
    import numpy as np
    import tcoll
    comm = tcoll.init(timeout=30)
    x = comm.empty(1 << 16, dtype=np.float64)
    x[:] = comm.rank + 1
    comm.all_reduce(x, algorithm="shm")
    assert np.all(x == comm.size * (comm.size + 1) / 2)
    open(f"ready.{comm.rank}", "w").write("1")
    comm.barrier()
    os.kill(os.getpid(), signal.SIGKILL)
"""


@pytest.mark.timeout(60)
def test_kill9_of_every_rank_holding_zero_copy_buffers_leaves_nothing(tmp_path: Path) -> None:
    (tmp_path / "job.py").write_text(textwrap.dedent(_JOB))
    run_id = f"leftovers{os.getpid()}"
    codes = run_ranks(tmp_path, ["job.py"], 2, run_id)
    assert codes == [-signal.SIGKILL] * 2
    assert all((tmp_path / f"ready.{rank}").exists() for rank in range(2))
    assert shm_segments(run_id) == []


def test_zero_copy_buffers_are_memory_files_not_dev_shm_files() -> None:
    from tcoll.shm.heap import Heap

    heap = Heap("memfdtest", 0)
    arr = heap.allocate(4096)
    arr[:] = 7
    heap_id, offset, nbytes = heap.locate(arr[8:16])  # type: ignore[misc]
    assert (offset, nbytes) == (8, 8) and heap_id >> 40 == os.getpid()
    assert shm_segments("memfdtest") == []
    reader = Heap("memfdtest", 1)
    assert np.array_equal(reader.view(0, heap_id, 0, 4096), arr)  # found through /proc/<pid>/fd
    reader.close()
    del arr
    gc.collect()
    with pytest.raises(TransportError, match="cannot be mapped"):
        Heap("memfdtest", 1).view(0, heap_id, 0, 8)  # freed with its array
    heap.close()


# Rank 0 creates the arena; rank 1, given its address, kills rank 0 (and itself) instead of mapping it.
_KILLED_OPENING = """
    import os, signal
    import numpy as np
    import tcoll
    from tcoll.comm import opening

    comm = tcoll.init(timeout=30)
    if comm.rank == 0:
        made = opening.create_segment

        def create_and_tell(*args):
            segment = made(*args)
            open("created", "w").write(str(os.getpid()))
            return segment

        opening.create_segment = create_and_tell
    else:
        def kill_instead(path, name):
            os.kill(int(open("created").read()), signal.SIGKILL)
            os.kill(os.getpid(), signal.SIGKILL)

        opening.open_segment = kill_instead
    comm.all_reduce(np.ones(4), algorithm="shm")
"""


@pytest.mark.timeout(60)
def test_kill9_while_the_arena_opens_leaves_nothing(tmp_path: Path) -> None:
    (tmp_path / "job.py").write_text(textwrap.dedent(_KILLED_OPENING))
    run_id = f"opening{os.getpid()}"
    codes = run_ranks(tmp_path, ["job.py"], 2, run_id)
    assert codes == [-signal.SIGKILL] * 2
    assert (tmp_path / "created").exists()
    assert shm_segments(run_id) == []


def test_a_memfd_let_go_is_never_mapped_through_its_reused_number() -> None:
    """/proc/<pid>/fd/<n> of a memfd its owner closed may name the next file opened: open refuses it by name."""
    from tcoll.segments import Segment, SegmentGoneError

    first = Segment.create_anonymous(f"tcoll-reuse{os.getpid()}-0-first", 4096)
    path, name = first.path, first.name
    number = first.fd
    first.unlink()  # its number is free now...
    second = Segment.create_anonymous(f"tcoll-reuse{os.getpid()}-0-second", 8192)
    if second.fd != number:  # ...and names another memfd (the next file opened got it, or is made to)
        os.dup2(second.fd, number)
    try:
        with pytest.raises(SegmentGoneError, match="no longer holds the memory file"):
            Segment.open(path, name)
        assert Segment.open(path, second.name).size == 8192
    finally:
        if second.fd != number:
            os.close(number)
        second.unlink()
        first.close()
        second.close()


def test_a_segment_gone_is_told_from_one_that_cannot_be_mapped(tmp_path: Path) -> None:
    """Only a missing file (or a reused number) reads as gone; other failures keep their own cause."""
    from tcoll.segments import Segment, SegmentGoneError

    with pytest.raises(SegmentGoneError, match="No such file"):
        Segment.open(str(tmp_path / "absent"))
    with pytest.raises(TransportError, match="Is a directory") as info:
        Segment.open(str(tmp_path))
    assert not isinstance(info.value, SegmentGoneError)
