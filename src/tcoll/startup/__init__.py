"""How a rank joins its job: the launchers' environments, the rendezvous, connecting, init and spawn.

Owns: reading rank/size/master from torchrun, Slurm, mpirun and tcoll run; the cards; transport choice per pair.
May import: comm (init returns a Communicator), transport, store, p2p, segments and the leaves.
"""
