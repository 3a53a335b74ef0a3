"""The command line: Typer app, options built from config dataclasses, rich progress and tables, `status`, the
demo and its local swarm of real processes. Nothing below imports this package; it may import all of them, but
only lazily inside commands (module import stays free of torch and hivemind so `hetero-node --help` is instant).
"""
