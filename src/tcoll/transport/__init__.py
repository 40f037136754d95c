"""Transports: the channels that carry one rank's messages to each peer (loopback, shm, tcp).

Owns: setting up channels (base), their byte streams, handshakes and liveness checks.
May import: p2p (the channel contract, work, waiting), store, segments and the leaves.
"""
