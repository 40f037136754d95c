"""All-gather: collect every rank's one-element array on every rank.

Run it with the launcher (4 ranks, as in the torch.distributed original):

    tcoll run -n 4 examples/collectives/all_gather.py

Rank r contributes [r.]; every rank receives them stacked in rank order, an
array of shape (4, 1), printed here as a flat array. Output (the order of
lines may vary):

    [0] data = [0. 1. 2. 3.]
    [2] data = [0. 1. 2. 3.]
    [3] data = [0. 1. 2. 3.]
    [1] data = [0. 1. 2. 3.]
"""

import numpy as np

import tcoll

comm = tcoll.init()
data = np.array([comm.rank], dtype=np.float32)
# Send every rank's array to all the others; every rank gets shape (size, 1).
gathered = comm.all_gather(data)
# All ranks have the arrays of all the ranks.
print(f"[{comm.rank}] data = {gathered.ravel()}")
comm.close()
