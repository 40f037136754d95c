"""Collective algorithms written on point-to-point: one module per collective, and what they share.

Owns: the registry, the cost model and its constants (select), how an algorithm runs (team), rank arithmetic
(topology) and shared building blocks (steps). May import: p2p and the leaves; never shm or comm.
"""
