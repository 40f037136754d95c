"""How a rank joins its job: launchers' environments, the rendezvous, connecting, init and spawn.

Owns: rank/size/master from tcoll run, torchrun, Slurm and mpirun; the cards; the transport of each pair.
May import: comm (init returns a Communicator) and everything below it.
"""
