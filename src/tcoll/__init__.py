"""tcoll: collective communication for Python.

Point-to-point and collective operations on NumPy arrays and PyTorch CPU
tensors, over shared memory inside a host and TCP between hosts.

    import numpy as np, tcoll
    comm = tcoll.init()                      # rank and size from the launcher
    x = np.full(4, comm.rank, dtype=np.float32)
    comm.send(x, dst=(comm.rank + 1) % comm.size)
"""

from .comm import Communicator
from .errors import (
    MessageSizeError,
    PeerLostError,
    RendezvousError,
    SpawnError,
    TcollError,
    TimeoutError,
    TransportError,
)
from .spawn import spawn
from .work import Work
from .world import default_communicator, init

__version__ = "0.1.0"

__all__ = [
    "Communicator",
    "Work",
    "init",
    "spawn",
    "default_communicator",
    "TcollError",
    "RendezvousError",
    "TimeoutError",
    "PeerLostError",
    "MessageSizeError",
    "TransportError",
    "SpawnError",
    "__version__",
]
