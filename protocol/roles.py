"""Role names, spelled one way: in peer records, the planner, the CLI's --role and the metrics.

A module of its own (no hivemind, no pydantic) so the planner and the CLI can use them without loading the DHT.
"""

from __future__ import annotations

ROLE_JOINING, ROLE_FULL, ROLE_STAGE = "joining", "full", "stage"
ROLES = (ROLE_JOINING, ROLE_FULL, ROLE_STAGE)
"""What a node does in the run: still choosing, a full replica, or a pipeline stage of a virtual replica."""

REQUEST_AUTO, REQUEST_FULL, REQUEST_STAGE = "auto", "full", "stage"
REQUESTED_ROLES = (REQUEST_AUTO, REQUEST_FULL, REQUEST_STAGE)
"""What a node asks for with --role: the planner decides (auto), a full replica, or a stage."""
