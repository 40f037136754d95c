"""Direct collectives for ranks on one host: every rank reads the others' data in one shared arena.

Owns: the arena (step counters, slots, descriptors), the zero-copy heap of comm.empty, the direct algorithms.
May import: algos (registry, cost constants, topology), p2p, segments and the leaves; never comm.
"""
