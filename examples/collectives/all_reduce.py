"""All-reduce: sum a one-element array of ones over all ranks, on every rank.

Run it with the launcher (4 ranks, as in the torch.distributed original):

    tcoll run -n 4 examples/collectives/all_reduce.py

Every rank starts with [1.] and ends with the sum over the ranks (4.0 with 4
ranks). Output (the order of lines may vary):

    [3] data = 4.0
    [0] data = 4.0
    [1] data = 4.0
    [2] data = 4.0
"""

import numpy as np

import tcoll

comm = tcoll.init()
data = np.ones(1, dtype=np.float32)
# Sum every rank's array, in place on every rank.
# op can also be "prod", "max", "min", "avg", ...
comm.all_reduce(data, op="sum")
# Every rank has the sum.
print(f"[{comm.rank}] data = {data[0]}")
comm.close()
