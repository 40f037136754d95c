"""How shared-memory segments are named, and how a run's leftovers are removed.

One convention, shared by the shm transport (which names segments) and by
`tcoll run` and `tcoll.spawn` (which sweep a finished run's leftovers).
"""

from __future__ import annotations

import os

__all__ = ["SHM_DIR", "segment_name", "remove_shm_segments"]

SHM_DIR = "/dev/shm"


def segment_name(run_id: str, rank: int, token: str) -> str:
    """The name of a rank's segment: tcoll-<run id>-<rank>-<random token>."""
    return f"tcoll-{run_id}-{rank}-{token}"


def remove_shm_segments(run_id: str, directory: str = SHM_DIR) -> list[str]:
    """Delete the shared-memory files of a run: ``<directory>/tcoll-<run_id>-*``.

    Args:
        run_id: the run's id; empty does nothing.
        directory: where POSIX shared memory lives.

    Returns:
        The names removed.
    """
    if not run_id:
        return []
    head, removed = f"tcoll-{run_id}-", []
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    for name in names:
        if name.startswith(head):
            try:
                os.unlink(os.path.join(directory, name))
                removed.append(name)
            except OSError:
                pass
    return removed
