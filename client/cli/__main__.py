"""`python -m hetero_node.client.cli`: the same entry point as the `hetero-node` console script."""

from hetero_node.client.cli.app import main

main()
