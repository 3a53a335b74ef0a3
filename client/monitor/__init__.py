"""What operators watch: a node's Prometheus metrics, the HTTP server that serves them, and the swarm dashboard
(a snapshot of the DHT's peer records, the rounds it has seen, one static page). May import `roles` (round
records), `swarm` and `protocol`; `node` and `cli` use it.
"""
