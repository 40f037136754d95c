"""Benchmarks: `tcoll bench p2p` and `tcoll bench <collective>`, nccl-tests style, beside gloo and MPI.

Owns: the bench cases, the plan, the timing sweep, tcoll's backend, the runner, background load, the report,
and the gloo and MPI workers it compares against.
May import: everything below the top (api, startup, comm, p2p, ...); only the cli imports it.
"""

__all__ = ["BenchError"]


class BenchError(RuntimeError):
    """An implementation's ranks failed or timed out."""
