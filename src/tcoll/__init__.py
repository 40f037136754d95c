"""tcoll: collective communication for Python.

Point-to-point and collective operations on NumPy arrays and PyTorch CPU
tensors, over shared memory inside a host and TCP between hosts.

    import numpy as np, tcoll
    comm = tcoll.init()                      # rank and size from the launcher
    x = np.full(4, comm.rank, dtype=np.float32)
    comm.all_reduce(x)                       # in place: every rank holds the sum
"""

from .algos.select import explain
from .api import (algorithms, all_gather, all_gather_object, all_gatherv, all_reduce, all_to_all, all_to_allv,
                  barrier, broadcast, broadcast_object, dup, gather, gather_object, gatherv, group, irecv, isend,
                  recv, recv_object, reduce, reduce_scatter, reduce_scatterv, scatter, scatter_object, scatterv,
                  send, send_object, split)
from .api import (all_to_all_object, exscan, exscan_object, iprobe, irecv_object, isend_object, probe, scan,
                  scan_object, sendrecv, sendrecv_object, sendrecv_replace)
from .comm.communicator import Communicator
from .comm.pairs import ANY_SOURCE, ANY_TAG, Status
from .comm.plans import Plan
from .errors import (MessageSizeError, MismatchError, PeerFailedError, PeerLostError, RendezvousError,
                     RevokedError, SpawnError, TcollError, TimeoutError, TransportError)
from .ops import AVG, BAND, BOR, BXOR, LAND, LOR, LXOR, MAX, MAXLOC, MIN, MINLOC, PROD, SUM, Op, loc_pairs
from .p2p.work import Work, test_some, wait_all, wait_any
from .startup.init import default_communicator, init
from .startup.spawn import spawn

__version__ = "0.1.0"

__all__ = [
    "Communicator", "Work", "Op", "Plan",
    "SUM", "PROD", "MIN", "MAX", "AVG", "BAND", "BOR", "BXOR", "LAND", "LOR", "LXOR", "MAXLOC", "MINLOC",
    "loc_pairs", "algorithms", "explain", "init", "spawn", "default_communicator",
    "TcollError", "RendezvousError", "TimeoutError", "PeerLostError", "PeerFailedError", "MessageSizeError",
    "MismatchError", "TransportError", "SpawnError", "RevokedError", "__version__",
    "send", "recv", "isend", "irecv",
    "all_reduce", "reduce", "broadcast", "all_gather", "gather", "scatter", "reduce_scatter", "all_to_all",
    "barrier", "all_gatherv", "gatherv", "scatterv", "all_to_allv", "reduce_scatterv",
    "broadcast_object", "all_gather_object", "gather_object", "scatter_object", "send_object", "recv_object",
    "split", "group", "dup",
    "ANY_SOURCE", "ANY_TAG", "Status", "wait_all", "wait_any", "test_some",
    "scan", "exscan", "scan_object", "exscan_object", "all_to_all_object", "sendrecv", "sendrecv_replace",
    "sendrecv_object", "probe", "iprobe", "isend_object", "irecv_object",
]


def __dir__() -> list[str]:
    """Public names only: the subpackages imported above (algos, comm, p2p, ...) are internals."""
    return sorted(__all__)
