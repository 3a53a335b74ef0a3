"""`hetero-node-lab sybil`: what thousands of record-only identities change in an honest node's view and votes.

A peer record costs its author one RSA key and no running node. The security review ground 4,097 peer ids below
every honest one (105 s of one core, 3.44 MiB of signed records) and left 0 of 5 honest records in each reader's
view, since readers kept the 4,096 lowest ids; the same records, counted as votes, chose the swarm's round and the
fingerprint a joiner loads. This bench feeds such floods to the reader's own code past the signature check (which
`tests/test_node_units.py` covers with real keys): `WorkLedger` (first sights, work, liveness), the record cap and
slot dating of `record_reader`, and the `view` functions every round decision reads. The honest swarm is 3 full
replicas at round 7 and one virtual replica (2 stages) whose stage 1 holds its slot since long ago; the Sybils
have ids ground below every honest one, claim round 8 with another fingerprint, and some claim that stage slot with
`claimed_at = 0`.

Four readers, each asked the same questions (does it keep the honest records, see the incumbent in its slot, take
round 7 as the swarm's, vouch for the honest fingerprint, and are Sybils among a shard's members):

* **records (before)**: the rules up to c0365d5: the lowest ids kept, votes over records, claims by their own date;
* **established**: a running honest node: it saw the honest peers first and certified rounds with them;
* **joiner**: a fresh node that sees everything at once; the Sybils do not answer its liveness challenge (no node
  stands behind them; the real challenge, an authenticated dial, is `bench-poison`'s record-only scenario), and it
  has challenged every record;
* **joiner, 30 reads**: the same joiner as a node is: it has read the records 30 times a second apart, each time
  challenging 64 of the peers it kept (`MAX_CHALLENGES`, contested slots' claimants first: `WorkLedger.to_challenge`),
  introduced to nobody (it joined through a stock hivemind-dht);
* **introduced, 30 reads**: that joiner introduced by the bootstrap it joined through (`protocol/introduction.py`) to
  the DHT nodes in its routing table: the honest peers, which talk to it; a record-only id never does
  (`tests/test_introduction.py` checks this over real libp2p).

Slots and a shard's members are read from the records the reader counts as running (what its planner and its rounds
read: `PeerRuntime.running` drops the peers that did not answer their last challenge).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import base58

from hetero_node.bench.config import SybilConfig
from hetero_node.bench.results import write_report
from hetero_node.bench.samples import record_fields
from hetero_node.client.swarm import view
from hetero_node.client.swarm.record_reader import MAX_RECORDS
from hetero_node.client.swarm.runtime import MAX_CHALLENGES
from hetero_node.client.swarm.work_ledger import ANSWERED, SILENT, WorkLedger
from hetero_node.protocol.records import PeerRecord
from hetero_node.protocol.roles import ROLE_FULL, ROLE_STAGE

HONEST_ROUND, STAGES = 7, 2
HONEST_FP, SYBIL_FP = "a" * 16, "b" * 16
NOW = 1_000_000.0
SEEN_AT = NOW - 3600.0
"""When the established reader first read the honest records (an hour before the flood)."""
SLOT_CLAIMERS = 16
"""Sybils that also claim the incumbent's slot, with `claimed_at = 0`."""
JOINER_READS = 30
"""Reads of the records (a second apart, as `RECORDS_REREAD_S` allows) the realistic joiner has made."""
READERS = (
    "records (before)",
    "established",
    "joiner",
    f"joiner, {JOINER_READS} reads",
    f"introduced, {JOINER_READS} reads",
)
Records = dict[str, PeerRecord]


def ground_id(i: int) -> str:
    """The i-th lowest-looking base58 id: what an attacker grinding ids below every honest one ends with."""
    digits = base58.BITCOIN_ALPHABET.decode()
    tail = "".join(digits[i // 58**k % 58] for k in reversed(range(4)))
    return f"111{tail}".ljust(46, "1")


def honest_records() -> Records:
    fields = {"round": HONEST_ROUND, "certified": HONEST_ROUND, "fingerprints": {"0": HONEST_FP, "1": HONEST_FP}}
    records = [PeerRecord(**record_fields(f"Qm{name}".ljust(46, "z"), role=ROLE_FULL, **fields)) for name in "ABC"]
    for stage in range(STAGES):
        records.append(PeerRecord(**record_fields(
            f"Qm{'S'}{stage + 1}".ljust(46, "z"), role=ROLE_STAGE, vr=0, stage=stage, claimed_at=SEEN_AT - 100,
            **{**fields, "fingerprints": {str(stage): HONEST_FP}},
        )))  # fmt: skip
    return {r.peer_id: r for r in records}


def sybil_records(count: int) -> Records:
    """`count` records one round ahead with another fingerprint; the first `SLOT_CLAIMERS` claim stage 1 of vr 0."""
    ahead = {"round": HONEST_ROUND + 1, "certified": HONEST_ROUND + 1, "written_at": NOW}
    records = {}
    for i in range(count):
        slot = {"role": ROLE_STAGE, "vr": 0, "stage": 1, "claimed_at": 0.0} if i < SLOT_CLAIMERS else {}
        fields = {"role": ROLE_FULL, **slot, **ahead, "fingerprints": {"0": SYBIL_FP, "1": SYBIL_FP}}
        records[ground_id(i)] = PeerRecord(**record_fields(ground_id(i), **fields))
    return records


@dataclass
class Reader:
    """One reader's rules: which records it keeps, how it dates claims, which records vote, and which of them its
    planner and rounds count as running (slots and a shard's members are read from those)."""

    keep: Callable[[Records], Records]
    voters: Callable[[Records], Records]
    running: Callable[[Records], Records]


def records_rule() -> Reader:
    """The rules before c0365d5."""
    return Reader(
        keep=lambda found: {pid: found[pid] for pid in sorted(found)[:MAX_RECORDS]},
        voters=lambda r: r,
        running=lambda r: r,
    )


def ledger_reader(ledger: WorkLedger) -> Reader:
    """What `latest_valid_records` and `PeerRuntime.voters` do with this ledger (liveness noted beforehand)."""

    def keep(found: Records) -> Records:
        ledger.note_records(found.values(), NOW)
        kept = ledger.keep(found, MAX_RECORDS, NOW) if len(found) > MAX_RECORDS else list(found)
        dated = {pid: found[pid] for pid in kept}
        return {pid: r.copy(update={"claimed_at": ledger.claimed_at(r)}) for pid, r in dated.items()}

    return Reader(
        keep=keep,
        voters=lambda records: ledger.voters(records, NOW) or {},
        running=lambda records: ledger.running(records, NOW),
    )


def established(honest: Records) -> Reader:
    ledger = WorkLedger()
    ledger.note_records(honest.values(), SEEN_AT)
    ledger.note_work(honest, NOW - 60)  # authors of the rounds it certified with them
    return ledger_reader(ledger)


def joiner(honest: Records, sybils: Records) -> Reader:
    ledger = WorkLedger()
    for pid in [*honest, *sybils]:
        ledger.note_challenge(pid, ANSWERED if pid in honest else SILENT, NOW)
    return ledger_reader(ledger)


def reading_joiner(honest: Records, found: Records, reads: int, introduced: Records | None = None) -> Reader:
    """A fresh node after `reads` reads of `found` a second apart, each challenging up to `MAX_CHALLENGES` of the
    peers it kept (introduced ones first, then contested slots' claimants), as `PeerRuntime.running` does; the honest
    answer. `introduced`: the peers it was introduced to as it joined (`PeerRuntime.ask_introductions`)."""
    ledger = WorkLedger()
    ledger.note_introduced(introduced or {}, NOW - reads)
    for i in range(reads):
        at = NOW - reads + i
        ledger.note_records(found.values(), at)
        kept = ledger.keep(found, MAX_RECORDS, at) if len(found) > MAX_RECORDS else list(found)
        for pid in ledger.to_challenge({pid: found[pid] for pid in kept}, at)[:MAX_CHALLENGES]:
            ledger.note_challenge(pid, ANSWERED if pid in honest else SILENT, at)
    return ledger_reader(ledger)


def judge(reader: Reader, honest: Records, found: Records) -> dict[str, Any]:
    """The questions every round decision depends on, asked of one reader's view of `found`."""
    started = time.perf_counter()
    kept = reader.keep(found)
    keep_s = time.perf_counter() - started
    voters, running = reader.voters(kept), reader.running(kept)
    incumbent = next(pid for pid, r in honest.items() if r.role == ROLE_STAGE and r.stage == 1)
    members = view.shard_members(running, 1, STAGES)
    return {
        "honest_kept": sum(pid in kept for pid in honest),
        "slot_kept": view.slot_holders(running, STAGES).get((0, 1)) == incumbent,
        "swarm_round": view.swarm_round(voters, me=""),
        "certified_round": view.swarm_round(voters, me="", certified=True),
        "vouched_honest": view.vouched_fingerprint(voters, HONEST_ROUND, "0", me="") == HONEST_FP,
        "vouched_ahead": view.vouched_fingerprint(voters, HONEST_ROUND + 1, "0", me=""),
        "sybil_members": sum(pid not in honest for pid in members),
        "read_ms": round(1000 * keep_s, 1),
    }


def run_sybil(cfg: SybilConfig, progress: Any = None) -> dict[str, Any]:
    """Every reader against every flood size; returns the report (also `out/report.json` and `report.md`)."""
    started = time.monotonic()
    honest = honest_records()
    task = progress.add_task("floods", total=len(cfg.flood_sizes)) if progress else None
    floods = {}
    for size in cfg.flood_sizes:
        sybils = sybil_records(size)
        found = {**sybils, **honest}
        readers = dict(zip(READERS, (records_rule(), established(honest), joiner(honest, sybils),
                                     reading_joiner(honest, found, JOINER_READS),
                                     reading_joiner(honest, found, JOINER_READS, introduced=honest)),
                           strict=True))  # fmt: skip
        floods[str(size)] = {name: judge(reader, honest, found) for name, reader in readers.items()}
        if progress is not None and task is not None:
            progress.advance(task)
    report = {"honest": len(honest), "cap": MAX_RECORDS, "wall_s": round(time.monotonic() - started, 1),
              "floods": floods}  # fmt: skip
    write_report(cfg.out, report, render_markdown(report))
    return report


def render_markdown(report: dict[str, Any]) -> str:
    lines = [
        f"Record-only Sybils against {report['honest']} honest records (3 full replicas at round {HONEST_ROUND}, one "
        f"2-stage virtual replica), view cap {report['cap']:,}; {report['wall_s']:g} s in all.\n",
        "| Sybil records | reader | honest kept | incumbent keeps its slot | swarm round (certified) | honest "
        "fingerprint vouched | Sybil fingerprint vouched | Sybils among shard 1's members | read ms |",
        "|---" * 9 + "|",
    ]
    for size, readers in report["floods"].items():
        for name, r in readers.items():
            slot, honest_fp = ("yes" if r[k] else "no" for k in ("slot_kept", "vouched_honest"))
            sybil_fp = "yes" if r["vouched_ahead"] == SYBIL_FP else "no"
            lines.append(
                f"| {int(size):,} | {name} | {r['honest_kept']} / {report['honest']} | {slot} "
                f"| {r['swarm_round']} ({r['certified_round']}) | {honest_fp} | {sybil_fp} | {r['sybil_members']:,} "
                f"| {r['read_ms']:g} |"
            )
    lines.append(
        f"\nGoal: every honest record kept, the incumbent in its slot, round {HONEST_ROUND} and the honest "
        "fingerprint for every reader. Sybils among the members are the groups' to sort out: a member that never "
        "states is left out of the round's set (`protocol/roster.py`), after the wait for it."
    )
    return "\n".join(lines) + "\n"
