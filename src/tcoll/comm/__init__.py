"""What users call: the Communicator, its collectives, and the one dispatcher that runs them.

Owns: argument checks, call descriptions, choosing and running every collective (dispatch), sub-communicators.
May import: shm, algos, transport, p2p, store, segments and the leaves; never startup or above.
"""
