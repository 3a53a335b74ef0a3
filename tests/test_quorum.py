"""A round counts only when more than half of the previous certificate's members sealed it: the rule as properties
(no two sides of a split both certify; joiners never make a quorum; the base shrinks only after `patience` rounds,
and only by members whose records are gone), then over real peers: cut off from half the swarm, two members void
the round instead of applying it, and the whole swarm certifies the next one from the same θ."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from factories import run_config
from hypothesis import given
from hypothesis import strategies as st
from shard_rounds import SHAPES, contribute

from hetero_node.bench.poison import swarm
from hetero_node.client.config import SyncTimeouts
from hetero_node.client.outer.shard_sync import ShardOutcome, ShardSync, Unreachable
from hetero_node.models.shards import fingerprint
from hetero_node.protocol import tensor_file
from hetero_node.protocol.quorum import Certificate, certifies, quorum_base
from hetero_node.protocol.roster import Seal

NAMES = st.text(alphabet="abcdefgh", min_size=1, max_size=2)


@given(base=st.frozensets(NAMES, min_size=1, max_size=9), joiners=st.frozensets(NAMES, max_size=4), data=st.data())
def test_two_sides_of_a_split_never_both_certify(base: frozenset[str], joiners: frozenset[str], data) -> None:
    everyone = sorted(base | joiners)
    side = data.draw(st.frozensets(st.sampled_from(everyone)))
    other = frozenset(everyone) - side
    assert not (certifies(side, base) and certifies(other, base))
    assert certifies(base, base)  # everyone sealing is always a quorum
    assert not certifies(joiners - base, base)  # newcomers alone never are


@given(
    members=st.frozensets(NAMES, min_size=1, max_size=9),
    live=st.frozensets(NAMES, max_size=9),
    since=st.integers(0, 12),
    patience=st.integers(1, 6),
)
def test_the_base_shrinks_only_after_patience_and_only_by_the_gone(
    members: frozenset[str], live: frozenset[str], since: int, patience: int
) -> None:
    previous = Certificate(3, members, "ab")
    base = quorum_base(previous, since, patience, live, expected=["zz"])
    if since < patience:
        assert base == members
    else:
        assert base == (members & live or members)  # never empty: someone must still seal
    assert base <= members
    assert quorum_base(None, since, patience, live, expected=["x", "y"]) == {"x", "y"}  # no certificate yet


@given(members=st.frozensets(NAMES, max_size=9), round_=st.integers(0, 1 << 20))
def test_a_certificate_survives_a_checkpoint_and_garbage_is_none(members: frozenset[str], round_: int) -> None:
    certificate = Certificate(round_, members, "ab12")
    assert Certificate.from_dict(tensor_file.loads(tensor_file.dumps(certificate.to_dict()))) == certificate
    for garbage in (None, [], {"round": "3", "members": [], "start_fp": ""}, {"round": 3, "members": [1]}):
        assert Certificate.from_dict(garbage) is None


@pytest.mark.multipeer
@pytest.mark.timeout(180)
def test_a_half_cut_off_voids_its_round_and_the_whole_swarm_certifies_the_next() -> None:
    with swarm(4) as runtimes:
        stop = threading.Event()
        syncs = [ShardSync(r, run_config(), 0, SHAPES, SyncTimeouts(matchmaking_s=2.0), stop) for r in runtimes]
        start = [torch.full(s, 0.25) for s in SHAPES]
        round0 = contribute(syncs, 0, start, seed=0)
        assert all(o.new_tensors is not None and not o.uncertified and o.contributors == 4 for o in round0)
        assert all(s.certificate is not None and len(s.certificate.members) == 4 for s in syncs)
        after0 = round0[0].new_tensors
        assert after0 is not None

        # round 1: two of the four see only each other (2 of a base of 4 is no majority): neither applies it
        cut_off = contribute(syncs[:2], 1, after0, seed=10)
        assert [(o.new_tensors, o.uncertified, o.group_size) for o in cut_off] == [(None, True, 2), (None, True, 2)]
        assert all(s.certificate is not None and s.certificate.round == 0 for s in syncs[:2])

        # round 2: everyone, from the θ round 1 left unchanged, certifies and agrees
        round2 = contribute(syncs, 2, after0, seed=20)
        results = [o.new_tensors for o in round2]
        assert all(r is not None and not o.uncertified for r, o in zip(results, round2, strict=True))
        assert len({fingerprint(r) for r in results}) == 1  # type: ignore[arg-type]

        # round 3: three of the four (a majority of round 2's) certify without the fourth
        majority = contribute(syncs[:3], 3, results[0], seed=30)  # type: ignore[arg-type]
        assert all(o.new_tensors is not None and o.contributors == 3 for o in majority)
        assert syncs[0].certificate is not None and syncs[0].certificate.members == {s.me for s in syncs[:3]}

        # the fourth alone in round 4 (1 of its last certificate's 4): it applies nothing and keeps its Δ owed
        lonely, theta = syncs[3], results[0]
        assert theta is not None
        pending = lonely.contribution(4, theta, fingerprint(theta), [1e-2 * torch.ones(s) for s in SHAPES], 64)
        alone = lonely.solo(pending, live=[lonely.me])
        assert (alone.new_tensors, alone.uncertified, alone.deferred) == (None, True, True)


@pytest.mark.multipeer
@pytest.mark.timeout(180)
def test_the_first_round_waits_for_a_slower_members_statement_instead_of_splitting_the_vote() -> None:
    """The GPU check's swarm voided round 0: its full replicas trained it in 2 s and sealed at their deadline's
    grace, its stage peers' statements came after H steps of 8 s, and a round no certificate came before is decided
    only unanimously. Now the founding members wait for every member's statement (up to --round-timeout-s)."""
    from hivemind.utils import get_dht_time

    with swarm(3) as runtimes:
        stop = threading.Event()
        timeouts = SyncTimeouts(matchmaking_s=1.0, round_timeout_s=30.0)
        syncs = [ShardSync(r, run_config(), 0, SHAPES, timeouts, stop) for r in runtimes]
        names, start = [s.me for s in syncs], [torch.full(s, 0.25) for s in SHAPES]

        def member(i: int, delay_s: float) -> ShardOutcome:
            time.sleep(delay_s)
            delta = [1e-2 * torch.randn(s, generator=torch.Generator().manual_seed(i)) for s in SHAPES]
            pending = syncs[i].contribution(0, start, fingerprint(start), delta, 64)
            syncs[i].begin(pending, coming=names, live=names, scheduled_time=get_dht_time() + 1.0)
            return syncs[i].finish(pending, lambda: False, lambda: None)

        with ThreadPoolExecutor(3) as pool:  # the third states its Δ 4 s after the others' seal-by time
            outcomes = [job.result() for job in [pool.submit(member, i, 5.0 * (i == 2)) for i in range(3)]]
        assert all(o.new_tensors is not None and not o.uncertified and o.contributors == 3 for o in outcomes)
        assert len({fingerprint(o.new_tensors) for o in outcomes}) == 1  # type: ignore[arg-type]


@pytest.mark.multipeer
@pytest.mark.timeout(180)
def test_a_message_whose_author_died_comes_from_a_member_that_verified_it_or_the_round_is_not_ours_to_apply() -> None:
    """The kill soak's other fork: an author killed after sealing left one member without its message, which dropped
    it and applied another aggregate than the member that had fetched it. Now a lost message comes from any member
    holding a verified copy; with no copy anywhere and the author unreachable, the member applies nothing
    (`Unreachable`: it takes the round's result from the others) instead of dropping the message alone."""
    from hetero_node.protocol.roster import Entry
    from hetero_node.protocol.round_wire import message_kind

    with swarm(3) as runtimes:
        stop = threading.Event()
        author, keeper, late = (
            ShardSync(r, run_config(), 0, SHAPES, SyncTimeouts(fetch_timeout_s=2.0), stop) for r in runtimes
        )
        start = [torch.full(s, 0.25) for s in SHAPES]
        sent = author.contribution(5, start, fingerprint(start), [1e-2 * torch.ones(s) for s in SHAPES], 64)
        assert sent.payload is not None
        entry = Entry(author.me, sent.meta.size, sent.meta.digest, sent.meta.tokens)
        members = [ShardSync._member(Entry(s.me, 0, "", 0), 5, sent.meta.start_fp) for s in (keeper, late)]
        members.append(ShardSync._member(entry, 5, sent.meta.start_fp))
        peers = {m.name: m.peer_id for m in members}
        keeper.runtime.publish(message_kind(sent.meta.digest), 0, 5, sent.payload)  # it verified the message
        runtimes[0].shutdown()  # the author is killed before `late` fetched it

        receiving = late.contribution(5, start, fingerprint(start), None, 0)
        # in a group of three every member's relay parent is the author: the copy can only come from the keeper
        got, dropped, _ = late._collect_messages(receiving, [members[-1]], peers)
        assert [r.digest for r in got] == [sent.meta.digest] and not dropped

        keeper.runtime.publish(message_kind(sent.meta.digest), 0, 5, b"")  # its copy is gone: no good one anywhere
        with pytest.raises(Unreachable):
            late._collect_messages(receiving, [members[-1]], peers)


def certified_round_zero(runtimes: list, stop: threading.Event) -> tuple[list[ShardSync], list[torch.Tensor]]:
    """One member per runtime, and θ(1) of a round 0 every one of them certified."""
    syncs = [ShardSync(r, run_config(), 0, SHAPES, SyncTimeouts(), stop) for r in runtimes]
    theta = contribute(syncs, 0, [torch.full(s, 0.5) for s in SHAPES], seed=0)[0].new_tensors
    assert theta is not None and all(s.certificate is not None and len(s.certificate.members) == 3 for s in syncs)
    return syncs, theta


@pytest.mark.multipeer
@pytest.mark.timeout(180)
def test_a_member_that_loaded_a_state_seals_for_the_deciders_and_takes_their_base_from_the_manifest() -> None:
    """The kill soak's last fork: a member that loaded a state took its quorum base from the seals it read, another
    base than the deciders', and certified a second set of one round. Now it reads the certificate the deciders
    stored in the DHT; when none is there, it only seals (its seal still counts for them) and takes the result, and
    with it their certificate, from a manifest."""
    from hetero_node.client.outer.catch_up import catch_up_shard
    from hetero_node.client.outer.roster_round import round_certificate

    with swarm(3) as runtimes:
        stop = threading.Event()
        syncs, theta = certified_round_zero(runtimes, stop)

        def stored(round_: int, wait_s: float = 0.0) -> Certificate | None:
            return round_certificate(runtimes[2], run_config().run_id, 0, round_, 10**6, stop, wait_s)

        assert stored(0, wait_s=30.0) == syncs[0].certificate  # stores are fire-and-forget: it waits for them
        assert stored(1) is None and stored(19) is None  # nothing decided there: unknown, never an older round's

        deciding, loaded = syncs[1], syncs[2]  # syncs[0] is gone for round 20
        loaded.adopt(None, known=False)  # as after a state whose round no record nor manifest told the base of
        decider, follower = contribute([deciding, loaded], 20, theta, seed=10)
        assert decider.new_tensors is not None and decider.contributors == 2  # 2 of the base of 3: the follower's seal
        assert follower.new_tensors is None and not follower.uncertified and follower.deferred

        got = catch_up_shard(loaded, 20, theta, fingerprint(theta), [deciding.me], 10.0)
        assert got is not None and fingerprint(got.tensors) == fingerprint(decider.new_tensors)
        assert got.certificate == deciding.certificate and got.certificate.members == {deciding.me, loaded.me}
        loaded.adopt(got.certificate)
        assert not loaded.follows and loaded.quorum(21, [], []) == deciding.quorum(21, [], [])  # one base for both


@pytest.mark.multipeer
@pytest.mark.timeout(180)
def test_a_member_restarted_or_rejoining_mid_round_keeps_the_seal_it_cast_before() -> None:
    """A seal is a vote: a member killed after sealing and restarted from its checkpoint runs the same round again
    with a new message; a new seal would change its vote after others counted it. It keeps the stored one, and since
    the round's set holds its old message, which it no longer has, it applies nothing of its own. So for every
    later round it had sealed before the restart, and for a round it comes back to after sealing later ones (it had
    voided it, and rebuilt it from messages once others certified it late: the CI run in which two members each
    re-sealed rounds the other had voided, and chased each other to the end of the run)."""
    from hetero_node.client.outer.roster_round import RosterRound

    with swarm(3) as runtimes:
        stop = threading.Event()
        syncs, theta = certified_round_zero(runtimes, stop)
        contribute(syncs, 1, theta, seed=10)  # every member sealed rounds 1 and 2
        contribute(syncs, 2, theta, seed=20)

        def seal_of(sync: ShardSync, round_: int) -> Seal | None:
            return (RosterRound(runtimes[2], run_config().run_id, 0, round_, 10**6, stop).seals() or {}).get(sync.me)

        before = {round_: seal_of(syncs[2], round_) for round_ in (1, 2)}
        assert None not in before.values()

        restarted = ShardSync(runtimes[2], run_config(), 0, SHAPES, SyncTimeouts(), stop)  # same key, fresh memory
        restarted.certificate, restarted.resumed_at = syncs[2].certificate, 1
        for round_ in (1, 2):
            again = contribute([restarted], round_, theta, seed=99)[0]  # a new Δ: another digest than the sealed one
            assert again.new_tensors is None and again.deferred  # its old message is in the set: Unreachable
        time.sleep(1.0)  # a new seal (the bug) would be stored by now
        assert {round_: seal_of(syncs[2], round_) for round_ in (1, 2)} == before

        # a member that comes back to a round it sealed, having sealed a later one since, keeps its vote the same
        # way, with no restart to tell it so
        member = syncs[1]
        sealed = seal_of(member, 1)
        assert sealed is not None and member.votes[1] == sealed
        rejoined = contribute([member], 1, theta, seed=77)[0]
        assert rejoined.new_tensors is None and rejoined.deferred
        time.sleep(1.0)
        assert seal_of(member, 1) == sealed

        # a member alone in its base decides a round alone (`solo`): that is its vote too, stored like a seal, and
        # neither it coming back to the round nor its restart decides the round a second time
        base_of_five = Certificate(4, frozenset({member.me}), fingerprint(theta))
        member.adopt(base_of_five)

        def alone(sync: ShardSync, seed: int) -> ShardOutcome:
            delta = [1e-2 * torch.randn(s, generator=torch.Generator().manual_seed(seed)) for s in SHAPES]
            return sync.solo(sync.contribution(5, theta, fingerprint(theta), delta, 64), live=[sync.me])

        first = alone(member, seed=5)
        assert first.new_tensors is not None and member.certificate is not None and member.certificate.round == 5
        certified = member.certificate
        again = alone(member, seed=6)
        assert (again.new_tensors, again.uncertified, again.deferred) == (None, True, True)
        assert member.certificate == certified
        time.sleep(1.0)
        solo_seal = seal_of(member, 5)
        assert solo_seal is not None and solo_seal == member.votes[5]
        restarted = ShardSync(runtimes[1], run_config(), 0, SHAPES, SyncTimeouts(), stop)
        restarted.certificate, restarted.resumed_at = base_of_five, 5
        assert alone(restarted, seed=7).new_tensors is None and restarted.certificate == base_of_five


@pytest.mark.multipeer
@pytest.mark.timeout(180)
def test_members_wait_for_a_late_base_members_seal_instead_of_voiding_a_round_it_then_decides() -> None:
    """The kill soak's fork of round 41: the base was two members; three gave the round up after --matchmaking-s
    with one seal in, and the other base member, a restarted stage that had just loaded a state, sealed 4 s later,
    read a majority and applied a set they had voided. Now a member waits on (up to --round-timeout-s) while a base
    member that has not sealed may still (`Contributing.may_seal`: its record is fresh and a round away at most);
    told that none may, it voids as before."""
    from hivemind.utils import get_dht_time

    with swarm(3) as runtimes:
        stop = threading.Event()
        timeouts = SyncTimeouts(matchmaking_s=1.0, round_timeout_s=30.0)
        syncs = [ShardSync(r, run_config(), 0, SHAPES, timeouts, stop) for r in runtimes]
        start = [torch.full(s, 0.25) for s in SHAPES]
        round0 = contribute(syncs[:2], 0, start, seed=0)  # members 0 and 1: round 1's base
        theta = round0[0].new_tensors
        assert theta is not None and all(s.certificate is not None for s in syncs[:2])
        syncs[2].adopt(syncs[0].certificate)  # member 2 took θ(1) and its certificate from them
        names = [s.me for s in syncs]

        def member(i: int, round_: int, delay_s: float, in_reach: bool) -> ShardOutcome:
            time.sleep(delay_s)
            delta = [1e-2 * torch.randn(s, generator=torch.Generator().manual_seed(10 * round_ + i)) for s in SHAPES]
            pending = syncs[i].contribution(round_, theta, fingerprint(theta), delta, 64)
            syncs[i].begin(pending, coming=names, live=names, scheduled_time=get_dht_time() + 1.0)
            outcome = syncs[i].finish(pending, lambda: False, lambda: None, lambda missing: in_reach)
            if not outcome.contributed:
                syncs[i].drop(pending)
            return outcome

        with ThreadPoolExecutor(3) as pool:  # base member 1 seals after the others' --matchmaking-s
            jobs = [pool.submit(member, i, 1, 4.0 * (i == 1), in_reach=True) for i in range(3)]
            outcomes = [job.result() for job in jobs]
        assert all(o.new_tensors is not None and not o.uncertified for o in outcomes), outcomes
        assert len({fingerprint(o.new_tensors) for o in outcomes}) == 1  # type: ignore[arg-type]
        assert {o.contributors for o in outcomes} == {2}  # members 0 and 2: member 1 stated after they sealed

        theta = outcomes[0].new_tensors
        # round 2's base is round 1's authors, members 0 and 2; told that member 0 will not seal (its record is
        # stale, or past the round), members 1 and 2 void it after --matchmaking-s
        started = time.monotonic()
        with ThreadPoolExecutor(2) as pool:
            late = [pool.submit(member, i, 2, 0.0, in_reach=False) for i in (1, 2)]
            voided = [job.result() for job in late]
        assert all(o.new_tensors is None and o.uncertified for o in voided), voided
        assert time.monotonic() - started < timeouts.round_timeout_s


@pytest.mark.multipeer
@pytest.mark.timeout(180)
def test_members_decide_without_waiting_for_a_seal_the_decision_does_not_need() -> None:
    """A member on a far link seals a second or more after the others (its statement store and its read of theirs
    each cross its round trip), and the others waited for every member their seal lists: 0.9 s more per round on the
    netlab's slow-link run. Once the seals in decide the round (more than half of the base sealed, every listed
    statement in or out) the set is the same whichever seals decided it, so they go on, and the late member decides
    the same set from the same seals plus its own."""
    from hivemind.utils import get_dht_time

    with swarm(4) as runtimes:
        stop = threading.Event()
        timeouts = SyncTimeouts(matchmaking_s=30.0, round_timeout_s=30.0)
        syncs = [ShardSync(r, run_config(), 0, SHAPES, timeouts, stop) for r in runtimes]
        start = [torch.full(s, 0.25) for s in SHAPES]
        round0 = contribute(syncs, 0, start, seed=0)
        theta = round0[0].new_tensors
        assert theta is not None and all(s.certificate is not None for s in syncs)
        names, finished_at, late_seal_at = [s.me for s in syncs], {}, []
        for runtime in runtimes:  # member 3 is on a slow uplink: a leaf of every relay tree, as its record would say
            runtime.uplinks = {name: 5.0 if i == 3 else 1000.0 for i, name in enumerate(names)}

        def member(i: int) -> ShardOutcome:
            delta = [1e-2 * torch.randn(s, generator=torch.Generator().manual_seed(10 + i)) for s in SHAPES]
            pending = syncs[i].contribution(1, theta, fingerprint(theta), delta, 64)
            syncs[i].begin(pending, coming=names, live=names, scheduled_time=get_dht_time() + 1.0)
            if i == 3:  # stated with the others; seals 8 s after them
                time.sleep(8.0)
                late_seal_at.append(time.monotonic())
            outcome = syncs[i].finish(pending, lambda: False, lambda: None)
            finished_at[i] = time.monotonic()
            return outcome

        with ThreadPoolExecutor(4) as pool:
            outcomes = [job.result() for job in [pool.submit(member, i) for i in range(4)]]
        assert all(o.new_tensors is not None and o.contributors == 4 for o in outcomes), outcomes
        assert len({fingerprint(o.new_tensors) for o in outcomes}) == 1  # type: ignore[arg-type]
        assert all(finished_at[i] < late_seal_at[0] for i in range(3)), "the others waited for the late seal"
