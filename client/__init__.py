"""The node a volunteer runs, as six packages stacked one way (each imports only the ones below it):

cli      the face: the Typer app, options built from configs, progress, status, doctor, export, the demo
node     joining: learn the run, measure this machine, make sure others can reach it, hand over to a role
monitor  what operators watch: Prometheus metrics, their HTTP server, the swarm dashboard
roles    what a node trains as: full replica, pipeline stage, the shared round loop, checkpoints, metrics
outer    one shard's outer round across peers: group, exchange, verify; state blobs and catch-up
swarm    the swarm as one peer sees it: DHT runtime, records, planner, membership, who holds which slot, relays

`config.py` (node-side configs) sits beside them; `protocol/` and `models/` are below all of them.
"""
