"""Transports: the channels that carry one rank's messages to each peer (loopback, shm, tcp, mpi).

Owns: setting up channels (base), their byte streams, handshakes and liveness checks. The shared-memory
and TCP transports are folders of the same modules (`transport`: set-up, `channel`: one peer's messages);
loopback and mpi are one module each.
May import: p2p (the channel contract, work, waiting), store, segments and the leaves.
"""
