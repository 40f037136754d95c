"""One rank of the tcoll-mpi compare target: tcoll over its MPI engine, `mpiexec -n N python -m tcoll.bench.tcoll_mpi_worker PLAN OUT`.

The ranks meet through MPI (TCOLL_TRANSPORT=mpi, set by `tcoll bench`) and
run the plan with tcoll's own collectives, every message carried by MPI's
Isend/Irecv: the counterpart of the "mpi" target, MPI's own collectives.
"""

from __future__ import annotations

from ..startup.init import init
from .tcoll_backend import tcoll_worker
from .worker_io import read_plan, write_result


def main() -> None:
    plan, out = read_plan()
    comm = init()
    result = tcoll_worker(comm, plan)
    if comm.rank == 0:
        write_result(out, result)
    comm.close()


if __name__ == "__main__":
    main()
