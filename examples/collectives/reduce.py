"""Reduce: sum a one-element array of ones from every rank into rank 0.

Run it with the launcher (4 ranks, as in the torch.distributed original):

    tcoll run -n 4 examples/collectives/reduce.py

Every rank starts with [1.]; after the reduce, rank 0 holds the sum over the
ranks (4.0 with 4 ranks). The other ranks' arrays are left as they were (1.0);
torch.distributed with gloo leaves partial sums there instead, which you
should not rely on either way. Output (the order of lines may vary):

    [1] data = 1.0
    [0] data = 4.0
    [3] data = 1.0
    [2] data = 1.0
"""

import numpy as np

import tcoll

comm = tcoll.init()
data = np.ones(1, dtype=np.float32)
# Send every rank's array to rank 0 and sum them there, in place.
# op can also be "prod", "max", "min", "avg", ...
comm.reduce(data, root=0, op="sum")
# Only rank 0 has the sum.
print(f"[{comm.rank}] data = {data[0]}")
comm.close()
