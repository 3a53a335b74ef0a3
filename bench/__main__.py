"""`python -m hetero_node.bench`: the same entry point as the `hetero-node-lab` console script."""

from hetero_node.bench.cli import main

main()
