"""One rank of the MPI compare target: `mpiexec -n N python -m tcoll.bench.mpi_worker PLAN OUT`.

Uses mpi4py's buffer interface (Allreduce, Reduce, Bcast, Allgather, Gather,
Scatter, Reduce_scatter_block, Alltoall, Barrier) on the bench's NumPy arrays.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from .collectives import BenchCase, Buffers, Params
from .sweep import Backend, sweep
from .worker_io import read_plan, write_result


class MpiBackend(Backend):
    """mpi4py's COMM_WORLD on one rank."""

    name = "mpi"

    def __init__(self) -> None:
        from mpi4py import MPI

        self.MPI = MPI
        self.comm = MPI.COMM_WORLD
        self.rank = self.comm.Get_rank()
        self.size = self.comm.Get_size()
        self.recoverable = (ValueError, TypeError, NotImplementedError, KeyError, BufferError, MPI.Exception)

    def barrier(self) -> None:
        self.comm.Barrier()

    def max_all(self, value: float) -> float:
        return float(self.comm.allreduce(value, op=self.MPI.MAX))

    def sum_all(self, value: int) -> int:
        return int(self.comm.allreduce(value, op=self.MPI.SUM))

    def bind(self, case: BenchCase, bufs: Buffers, p: Params) -> Callable[[], Any]:
        if p.dtype.name == "bfloat16" and not case.reduces:  # MPI has no bfloat16, but moving bytes is moving bytes
            bufs = Buffers(*(None if b is None else b.view(np.uint16) for b in (bufs.inp, bufs.out)))
        op = {"sum": self.MPI.SUM, "prod": self.MPI.PROD, "min": self.MPI.MIN, "max": self.MPI.MAX}[p.op]
        return case.mpi(self.comm, bufs, p, op)

    def info(self) -> dict[str, Any]:
        import mpi4py

        library = self.MPI.Get_library_version().strip().splitlines()
        return {"mpi4py": mpi4py.__version__, "library": " ".join(library[0].split()) if library else "?"}


def main() -> None:
    plan, out = read_plan()
    backend = MpiBackend()
    rows = sweep(backend, plan)
    if backend.rank == 0:
        write_result(out, {"rows": rows, "info": backend.info()})


if __name__ == "__main__":
    main()
