"""The shared-memory transport, for ranks on one host.

`transport` sets up (ShmTransport: a segment per rank, mapped by its local peers), `rings` holds the
ring layout and the copies in and out (and loads the ring kernel, `_ring_kernel.c`), `channel` moves
one peer's messages (ShmChannel).
"""
