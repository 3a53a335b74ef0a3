"""One replica across the devices of one machine: its local ranks, started and ended by the node (rank 0)."""
