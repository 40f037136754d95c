"""Collective algorithms written on point-to-point, one module per collective.

Importing this package registers every algorithm (see `registry`).
"""

from . import (all_gather, all_reduce, all_to_all, barrier, broadcast, gather_scatter, reduce, reduce_scatter,
               shm_direct, shm_movement)
from .registry import REGISTRY, AlgorithmInfo, Costs, algorithm, lookup, names

__all__ = ["REGISTRY", "AlgorithmInfo", "Costs", "algorithm", "lookup", "names",
           "all_gather", "all_reduce", "all_to_all", "barrier", "broadcast", "gather_scatter", "reduce",
           "reduce_scatter", "shm_direct", "shm_movement"]
