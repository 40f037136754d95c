"""One rank's point-to-point engine: matching of receives, progress, adaptive waiting, liveness.

Owns: the engine, Work handles, the doorbell and spin policy, and the contract a transport's channels
fulfil (channel). Imports: the leaves only (errors, env); transports plug in through the contract.
"""
