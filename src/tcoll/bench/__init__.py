"""Benchmarks: `tcoll bench p2p` (point-to-point latency and bandwidth)."""
