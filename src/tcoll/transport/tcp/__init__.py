"""The TCP transport: a socket per peer, between hosts (or on one host when forced).

`transport` sets up (TcpTransport: listener, card, the watcher thread), `connect` dials, accepts and
authenticates the connections, `channel` moves one peer's messages (TcpChannel).
"""
