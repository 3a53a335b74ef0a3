"""One parameter shard's outer round across peers: matchmaking (hivemind), the exchange of compressed messages,
their verification, catch-up from a round's messages, and verified state blobs. The arithmetic every member must
get bit for bit lives in `protocol/outer_methods.py`. May import `swarm`, `protocol`, `models`.
"""
