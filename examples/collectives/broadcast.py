"""Broadcast: copy rank 0's array into the array of every other rank.

Run it with the launcher (4 ranks, as in the torch.distributed original):

    tcoll run -n 4 examples/collectives/broadcast.py

Rank 0 holds [0.]; the other ranks start with an uninitialised array and end
with rank 0's [0.]. Output (the order of lines may vary):

    [2] data = [0.]
    [1] data = [0.]
    [3] data = [0.]
    [0] data = [0.]
"""

import numpy as np

import tcoll

comm = tcoll.init()
if comm.rank == 0:
    data = np.array([comm.rank], dtype=np.float32)
else:
    data = np.empty(1, dtype=np.float32)  # overwritten by the broadcast
# Copy rank 0's array into every rank's array, in place.
comm.broadcast(data, root=0)
# All ranks have rank 0's data.
print(f"[{comm.rank}] data = {data}")
comm.close()
