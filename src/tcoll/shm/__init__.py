"""Direct collectives for ranks on one host: every rank reads the others' data in one shared arena.

Owns: the arena (step counters, slots, descriptors), the zero-copy heap of `Communicator.empty`, and the
direct algorithms (vector: all_reduce, reduce, broadcast, barrier; blocks: the rest). Imports: algos'
registry and cost constants, p2p's waiting, segments and the leaves; never comm.
"""
