"""What users call: the Communicator, its collectives, and the one dispatcher that runs them.

Owns: argument checks, call descriptions, choosing and running every collective (dispatch), sub-communicators.
May import: algos, shm, p2p, transport (its base only), store (its base only), and the leaves.
"""
