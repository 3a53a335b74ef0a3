"""Joining a swarm: learn the run (announcement, run.toml, options), measure this machine (hardware, bandwidth,
throughput), and hand over to a role. May import `roles`, `outer`, `swarm`, `local`, `protocol`,
`models`.
"""
