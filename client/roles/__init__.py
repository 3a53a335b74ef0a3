"""What a node trains as: the round loop both roles share, the full replica, the pipeline-stage peer and its
GPipe schedule and links, local training, checkpoints, metrics. May import `outer`, `swarm`, `local`, `protocol`,
`models`.
"""
