"""Never crash on a valid record (issue 32): schema-valid records at the edges of every bound (0 Mbit/s, 10⁹
tokens/s, 0 or 10⁵ GB, stage 1023, vr 10⁶, deadlines at 10¹¹, relayed through peers that are not there) go through
the live planner with the cost model's judge and through every view function a round reads, and nothing raises.
A 0 Mbit/s record once made every joiner's planner divide by zero."""

from __future__ import annotations

from factories import peer_record, run_config
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hetero_node.client.swarm import view
from hetero_node.client.swarm.auto_plan import MarginalGain, requirements
from hetero_node.client.swarm.cost_model import RunShape
from hetero_node.client.swarm.membership import plan_from_records
from hetero_node.protocol.records import PeerRecord

SHAPE = RunShape.from_run(run_config())
EDGES = {
    "upload_mbps": [0.0, 1e-9, 1.0, 1e6],
    "download_mbps": [0.0, 1e-9, 1e6],
    "tokens_per_s": [0.0, 1e-6, 1e9],
    "memory_gb": [0.0, 0.001, 1e5],
    "role": ["joining", "full", "stage", "standby"],
    "requested_role": ["auto", "full", "stage"],
    "pinned_stage": [-1, 0, 1, 1023],
    "stage": [-1, 0, 1, 1023],
    "vr": [-1, 0, 1, 10**6],
    "claimed_at": [0.0, 1.0, 1e11],
    "round": [0, 1, 10**9],
    "certified": [0, 10**9],
    "train_round": [-1, 0, 10**9],
    "deadline": [0.0, 1e11],
    "step_s": [0.0, 1e-9, 1e5],
    "overhead_s": [0.0, 1e5],
    "devices": [1, 64],
    "addrs": [[], ["/ip4/10.0.0.1/tcp/1/p2p/QmRelayNotInTheSwarmxxxxxxxxxxxxxxxxxxxxxxx/p2p-circuit"]],
    "fingerprints": [{}, {"0": "ab" * 8, "1": "cd" * 8, "fixed": "ef" * 8}],
}


def records_strategy() -> st.SearchStrategy[dict[str, PeerRecord]]:
    changes = st.fixed_dictionaries({}, optional={k: st.sampled_from(v) for k, v in EDGES.items()})
    peers = st.lists(changes, min_size=1, max_size=7)
    return peers.map(lambda found: {r.peer_id: r for r in (peer_record(f"p{i}", **c) for i, c in enumerate(found))})


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(records=records_strategy())
def test_extreme_valid_records_crash_neither_the_planner_nor_the_view(records: dict[str, PeerRecord]) -> None:
    plan = plan_from_records(records, requirements(SHAPE), MarginalGain(SHAPE))
    assert set(plan.reasons) >= {pid for pid, r in records.items() if r.role == "joining"}
    me = next(iter(records))
    stages = SHAPE.stages
    view.slot_holders(records, stages)
    view.virtual_replicas(records, stages, complete=False)
    view.replica_count(records, stages)
    for shard in range(stages):
        view.shard_members(records, shard, stages)
        view.coming_members(records, 1, shard, stages)
        view.shard_donors(records, shard)
        view.vouched_fingerprint(records, 1, str(shard), me)
    view.swarm_round(records, me)
    view.swarm_round(records, me, certified=True)
