"""Never crash on a valid record (issue 32): schema-valid records at the edges of every bound (0 Mbit/s, 10⁹
tokens/s, 0 or 10⁵ GB, stage 1023, vr 10⁶, deadlines at 10¹¹, relayed through peers that are not there) go through
the live planner with the cost model's judge, every view function a round reads and the reader's ledger, and nothing
raises (`make bench-fuzz` feeds 10⁴ more).
A 0 Mbit/s record once made every joiner's planner divide by zero."""

from __future__ import annotations

from factories import peer_record, run_config
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hetero_node.bench.fuzz import judge_records
from hetero_node.bench.samples import RECORD_EDGES
from hetero_node.client.swarm.cost_model import RunShape
from hetero_node.protocol.records import PeerRecord

SHAPE = RunShape.from_run(run_config())


def records_strategy() -> st.SearchStrategy[dict[str, PeerRecord]]:
    changes = st.fixed_dictionaries({}, optional={k: st.sampled_from(v) for k, v in RECORD_EDGES.items()})
    peers = st.lists(changes, min_size=1, max_size=7)
    return peers.map(lambda found: {r.peer_id: r for r in (peer_record(f"p{i}", **c) for i, c in enumerate(found))})


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(records=records_strategy())
def test_extreme_valid_records_crash_neither_the_planner_nor_the_view(records: dict[str, PeerRecord]) -> None:
    plan = judge_records(records, SHAPE)
    assert set(plan.reasons) >= {pid for pid, r in records.items() if r.role == "joining"}
