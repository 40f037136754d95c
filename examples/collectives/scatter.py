"""Scatter: rank 0 holds one chunk per rank and sends chunk r to rank r.

Run it with the launcher (4 ranks, as in the torch.distributed original):

    tcoll run -n 4 examples/collectives/scatter.py

Rank 0 holds the chunks [1.], [2.], [3.], [4.]; rank r receives [r + 1.].
Output (the order of lines may vary):

    [2] data = 3.0
    [1] data = 2.0
    [3] data = 4.0
    [0] data = 1.0
"""

import numpy as np

import tcoll

comm = tcoll.init()
# Rank 0 holds one chunk per rank, stacked along the first axis: [[1.], [2.], [3.], [4.]].
# The other ranks pass None: only the root's chunks are sent.
chunks = np.arange(1, comm.size + 1, dtype=np.float32).reshape(comm.size, 1) if comm.rank == 0 else None
# Send chunk r of rank 0 to rank r; every rank gets its own chunk back.
data = comm.scatter(chunks, root=0)
# Each rank has a chunk holding its rank number + 1.
print(f"[{comm.rank}] data = {data[0]}")
comm.close()
