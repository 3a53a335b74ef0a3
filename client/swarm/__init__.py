"""The swarm as one peer sees it: the DHT runtime and blob transport, typed peer records, the planner, membership,
and the one answer to "who holds which slot". May import `protocol` and `models` only.
"""
