"""Benchmarks: `tcoll bench p2p` (point-to-point) and `tcoll bench <collective>` (nccl-tests style, with --compare gloo,mpi)."""
