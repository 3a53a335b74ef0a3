"""One parameter shard's outer round across peers: its contributor set (statements and seals in the DHT), the
exchange of compressed messages, their verification, catch-up from a round's messages, and verified state blobs.
The arithmetic every member must get bit for bit lives in `protocol/outer_methods.py`. May import `swarm`,
`protocol`, `models`.
"""
