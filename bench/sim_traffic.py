"""What the lab's traffic figures count: how many message-sized payloads a method moves per replica and round,
and what a virtual replica's later stages download to keep T_fixed. Shared by the lab (`sim.py`) and its report
(`sim_report.py`)."""

from __future__ import annotations

from hetero_node.protocol.run_config import RunConfig


def messages_moved(method: str, replicas: int, inner_steps: int, contributors: int = 0) -> float:
    """How many of its own messages' worth one replica moves per round: SparseLoCo's members each download every
    other member's message (R − 1); a dense all-reduce (DiLoCo's butterfly, ddp's ring) sends 2(R−1)/R of the
    buffer, ddp once per inner step. With K < R contributors a round moves K messages to R − 1 members each
    (the relay trees spread the uploads), K(R − 1)/R per replica."""
    if method == "ddp":
        return inner_steps * 2 * (replicas - 1) / replicas
    if 0 < contributors < replicas:
        return contributors * (replicas - 1) / replicas
    if method == "diloco":
        return 2 * (replicas - 1) / replicas
    return replicas - 1


def table_upkeep_bytes(run: RunConfig, change_bytes: int) -> int:
    """What every stage after the first of a virtual replica downloads after each outer step to keep T_fixed: the
    entries of E_S the step changed (`change_bytes`, one `embedding_change`'s tensors)."""
    if not (run.uses_subspace and run.pipeline.drift_transfer):
        return 0
    return (run.outer.stages - 1) * change_bytes
