"""Gather: collect every rank's one-element array on rank 0.

Run it with the launcher (4 ranks, as in the torch.distributed original):

    tcoll run -n 4 examples/collectives/gather.py

Rank r contributes [r.]; rank 0 receives them stacked in rank order, an array
of shape (4, 1), printed here as a flat array. Output:

    [0] data = [0. 1. 2. 3.]
"""

import numpy as np

import tcoll

comm = tcoll.init()
data = np.array([comm.rank], dtype=np.float32)
# Send every rank's array to rank 0; rank 0 gets shape (size, 1), the others None.
gathered = comm.gather(data, root=0)
# Only rank 0 has the arrays of all the ranks.
if comm.rank == 0:
    print(f"[{comm.rank}] data = {gathered.ravel()}")
comm.close()
