"""One replica across the devices of one machine (`--devices`): the device list, the local ranks the node starts
and ends (rank 0 is the node itself, the only one the swarm sees), and what they compute together. May import
`protocol` and `models` only.
"""
