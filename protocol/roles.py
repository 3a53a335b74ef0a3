"""Role names, spelled one way: in peer records, the planner, the CLI's --role and the metrics.

A module of its own (no hivemind, no pydantic) so the planner and the CLI can use them without loading the DHT.
"""

from __future__ import annotations

ROLE_JOINING, ROLE_FULL, ROLE_STAGE, ROLE_STANDBY = "joining", "full", "stage", "standby"
ROLES = (ROLE_JOINING, ROLE_FULL, ROLE_STAGE, ROLE_STANDBY)
"""What a node does in the run: still choosing, a full replica, a pipeline stage of a virtual replica, or waiting
(standby: the planner's model says a pipeline of nodes like it would slow the swarm; it is judged again at every
plan)."""

REQUEST_AUTO, REQUEST_FULL, REQUEST_STAGE = "auto", "full", "stage"
REQUESTED_ROLES = (REQUEST_AUTO, REQUEST_FULL, REQUEST_STAGE)
"""What a node asks for with --role: the planner decides (auto), a full replica, or a stage."""
