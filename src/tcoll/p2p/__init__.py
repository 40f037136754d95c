"""Point-to-point: one rank's engine, which matches receives, makes progress and waits adaptively.

Owns: the engine, Work handles, the doorbell and spin policy, the channel contract and message header.
May import: the leaves only (errors, env); transports plug in through the contract (channel).
"""
