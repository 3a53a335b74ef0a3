"""Catching up from a round's messages over real peers: a lone lying donor's manifest is outvoted, not trusted, and a
lone manifest among silent donors counts only if the records vouch for its result; the certificate the round's
members state comes with the result (the catching-up member's next quorum base), and a loaded state's certificate is
taken only when two manifests agree on it."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from factories import run_config

from hetero_node.bench.poison import swarm
from hetero_node.client.outer.catch_up import agreed_certificate, catch_up_shard
from hetero_node.client.swarm.runtime import PeerRuntime
from hetero_node.models.shards import fingerprint
from hetero_node.protocol.outer_methods import outer_method
from hetero_node.protocol.quorum import Certificate
from hetero_node.protocol.round_wire import MANIFEST, digest, encode_manifest, message_kind

pytestmark = [pytest.mark.multipeer, pytest.mark.timeout(180)]

SHAPES = [(64, 48), (300,)]
START = [torch.full(s, 0.5) for s in SHAPES]
ROUND = 3


def certificate_of(*authors: str) -> Certificate:
    return Certificate(ROUND, frozenset(authors), fingerprint(START))


def serve_round(runtime: PeerRuntime, sender: str, scale: float) -> str:
    """Serve round ROUND's manifest and message as a member whose group aggregated `sender`'s message (made with
    `scale`) and which certified it with `sender` and a receiver; returns the result's fingerprint."""
    run = run_config()
    gen = torch.Generator().manual_seed(0)
    payload = outer_method(run, SHAPES).encode([scale * torch.randn(s, generator=gen) for s in SHAPES]).payload
    member = outer_method(run, SHAPES)
    result = member.update(START, member.combine([member.decode(payload)], [64.0], [sender]))
    runtime.publish(message_kind(digest(payload)), 0, ROUND, payload)
    members = [(sender, digest(payload), 64)]
    manifest = encode_manifest(ROUND, fingerprint(START), fingerprint(result), members, certificate_of(sender, "rx"))
    runtime.publish(MANIFEST, 0, ROUND, manifest)
    return fingerprint(result)


def test_a_late_member_rebuilds_the_result_two_donors_state_not_a_lone_liars() -> None:
    with swarm(4) as (honest1, honest2, liar, late):
        honest = serve_round(honest1, "sender-a", 1e-2)
        assert serve_round(honest2, "sender-a", 1e-2) == honest
        assert serve_round(liar, "sender-b", 10.0) != honest
        sync = SimpleNamespace(runtime=late, shard=0, method=outer_method(run_config(), SHAPES))

        def rebuild(*donors: PeerRuntime) -> str | None:
            got = catch_up_shard(sync, ROUND, START, fingerprint(START), [str(d.peer_id) for d in donors], 10.0)
            assert got is None or got.certificate == certificate_of("sender-a", "rx")  # the honest members' base
            return None if got is None else fingerprint(got.tensors)

        def certificate(*donors: PeerRuntime) -> tuple[bool, Certificate | None]:
            return agreed_certificate(sync, ROUND, [str(d.peer_id) for d in donors], 10.0)

        assert rebuild(liar, honest1, honest2) == honest  # the liar asked first, outvoted
        assert certificate(liar, honest1, honest2) == (True, certificate_of("sender-a", "rx"))
        assert certificate(liar, honest1) == (False, None)  # one against one: the state's loader follows
        assert certificate(late, honest2) == (False, None)  # one manifest while another donor was asked
        assert certificate(honest2) == (True, certificate_of("sender-a", "rx"))  # the only donor there is
        assert rebuild(liar, honest1) is None  # one against one: neither is taken (the node loads state instead)
        assert rebuild(honest2) == honest  # the only donor there is: taken on its word
        silent = str(late.peer_id)  # asked too, serves no manifest of this round

        def rebuild_among_silent(donor: PeerRuntime, vouched: str | None) -> str | None:
            got = catch_up_shard(sync, ROUND, START, fingerprint(START), [str(donor.peer_id), silent], 10.0, vouched)
            return None if got is None else fingerprint(got.tensors)

        assert rebuild_among_silent(liar, None) is None  # a lone manifest while other donors exist: not believed
        assert rebuild_among_silent(liar, honest) is None  # nor against the records' majority
        assert rebuild_among_silent(honest1, honest) == honest  # the records vouch for it
