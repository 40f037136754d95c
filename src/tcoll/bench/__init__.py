"""Benchmarks: `tcoll bench p2p` and `tcoll bench <collective>`, nccl-tests style, beside gloo and MPI.

Owns: the bench cases, runner, report and the gloo/MPI workers. May import: everything below the top
(api, startup, comm, p2p); nothing imports it but the cli.
"""

__all__ = ["BenchError"]


class BenchError(RuntimeError):
    """An implementation's ranks failed or timed out."""
