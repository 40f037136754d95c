"""Start the seed examples' ranks: as one rank of a launcher, or all of them here.

The seed programs started 4 processes themselves on the fixed port 29500. Under
`tcoll run -n 4` or torchrun every copy did so too, and they fought over the port.
`start` runs a program both ways: under a launcher (RANK and WORLD_SIZE set) this
process is one rank of the launcher's job; alone, it starts `size` ranks on a free
port, and exits non-zero when one of them failed.
"""

import os
import socket
import sys

import torch.multiprocessing as mp


def start(target, size: int = 4, *args) -> None:
    """Run target(rank, world_size, *args) on every rank of the job."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # tcoll run, torchrun: we are one rank
        target(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), *args)
        return
    os.environ["MASTER_ADDR"] = os.environ.get("MASTER_ADDR", "127.0.0.1")
    if "MASTER_PORT" not in os.environ:
        with socket.socket() as probe:  # a port free now, instead of 29500 that another job may hold
            probe.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(probe.getsockname()[1])
    # fork: the ranks start with torch already imported (spawn imported it once more in each, seconds each);
    # this process has run no torch work yet, so there is no thread pool to lose in the children.
    mp.set_start_method("fork" if "fork" in mp.get_all_start_methods() else "spawn", force=True)
    processes = [mp.Process(target=target, args=(rank, size, *args)) for rank in range(size)]
    for p in processes:
        p.start()
    for p in processes:
        p.join()
    failed = [p.exitcode for p in processes if p.exitcode]
    if failed:
        sys.exit(failed[0] if failed[0] > 0 else 128 - failed[0])
