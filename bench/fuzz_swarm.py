"""`hetero-node-lab fuzz-swarm`: malformed inputs sent by a real peer process to a training swarm, over libp2p
streams and the DHT, while the swarm trains.

`hetero-node-lab fuzz` feeds the parsers in one process; this bench checks what sits in front of them on a live
node. A bootstrap, two full replicas and a virtual replica of two stages (real `hetero-node` processes training
`tiny`, as in `hetero-node-lab kills`) run on loopback; this process joins the swarm as a peer with its own p2p
daemon and DHT node and sends every peer, for every network entry point, inputs made from a valid one:

* stream handlers (state and payload blobs, stage messages, both bandwidth probes) get a valid request frame
  (hivemind's marker + 8-byte length + protobuf) whose fields are set at random (wrong kinds, shards, rounds,
  virtual replicas, stages, sizes) and, one time in two, whose bytes are then mutated as in `hetero-node-lab fuzz` (bit
  flips, truncations, huge declared lengths, random bytes, replays of another entry point's frame);
* the bootstrap's run-key RPC gets mutated request bytes;
* the DHT gets peer records and run announcements with one field wrong (`hetero-node-lab fuzz`'s structure mutations),
  signed by this peer, some claiming a real peer's id, stored under the run's keys.

Per entry point: inputs, answered with data, refused (error or closed), held open until the sender gave up. For
the swarm: peers still running at the end (goal all), rounds in which peers disagreed while fuzzed (goal 0),
rounds completed and contributed while fuzzed (goal: as without), each peer's peak RSS before and while fuzzed
(bounded: nothing is allocated before a size check), records in a validating reader's view that no real peer
wrote (goal 0), and the run a new joiner adopts afterwards (goal: the bootstrap's).
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from rich.progress import Progress

from hetero_node.bench.config import SwarmFuzzConfig
from hetero_node.bench.fuzz import mutate_bytes, mutate_structure
from hetero_node.bench.kill_soak import (
    disagreeing_rounds,
    peer_args,
    rounds_of,
    run_args,
    sigterm_and_wait,
    wait_until,
)
from hetero_node.bench.results import write_report
from hetero_node.bench.samples import record_fields
from hetero_node.bench.soak import sample_group
from hetero_node.client.cli.local_swarm import LocalSwarm, fresh_dir
from hetero_node.client.node.run_definition import fetch_run_announcement
from hetero_node.client.swarm.runtime import PeerRuntime, wire
from hetero_node.protocol.keys import RUN_KEY_HANDLER, blob_handler_name, peers_key, runs_key, stage_handler_name
from hetero_node.protocol.probe import PROBE_DOWNLOAD, PROBE_UPLOAD
from hetero_node.protocol.records import PeerRecord
from hetero_node.protocol.roles import ROLE_STAGE
from hetero_node.protocol.run_config import PROTOCOL_VERSION

PEERS = ["r0", "r1", "vr0-s0", "vr0-s1"]
IN_FLIGHT = 32
"""Inputs on their way at once: enough to keep every handler busy, few enough not to starve the swarm's own traffic
on 2 cores."""
DHT_IN_FLIGHT = 4
"""Stores on their way at once."""
MAX_STORED_BYTES = 3000
"""The largest value this peer stores: hivemind hands a store to its DHT process through a pipe whose reader dies on
a partially written message (`BlockingIOError` in `DHT._run`, measured with ~10 KB values, also at 4 in flight).
hetero-node's own records are about 1 KB; a receiving node gets values over libp2p, where size is no problem."""
ANSWER_WAIT_S = 1.0
READ_CAP_BYTES = 1 << 20
"""Bytes read from an answer before the stream is closed (a probe would send 32 MB)."""


@dataclass
class EntryTally:
    """What one entry point did with the inputs sent to it."""

    inputs: int = 0
    answered: int = 0
    refused: int = 0
    held_open: int = 0
    seconds: float = 0.0


@dataclass(frozen=True)
class StreamEntry:
    """A libp2p stream handler: its name, who serves it, and a random valid request frame for it."""

    name: str
    handler: str
    targets: str  # "all" peers, "stages", or "bootstrap"
    frames: Callable[[random.Random, int], list[Any]]
    unary: bool = False


def _blob_requests(rng: random.Random, round_: int) -> list[Any]:
    kind = rng.choice(["state", "payload", "manifest", "", "x" * rng.choice([1, 300, 5000]), "state\x00"])
    shard = rng.choice([0, 1, 2, 255, 2**32 - 1])
    at = rng.choice([round_, round_ + 1, round_ - 1, 0, 2**63, 2**64 - 1])
    return [wire.BlobRequest(kind=kind, shard=shard, round=max(0, at))]


def _stage_pieces(rng: random.Random, round_: int) -> list[Any]:
    size = rng.choice([0, 10, 1 << 20, 2**40, 2**64 - 1])
    return [
        wire.StagePiece(kind=rng.choice([0, 1, 2, 7]), vr=rng.choice([0, 1, 2**32 - 1]), stage=rng.choice([0, 1, 9]),
                        round=max(0, rng.choice([round_, round_ + 1, 2**63])), step=rng.randrange(2**32),
                        microbatch=rng.choice([0, 1, 2**32 - 1]), count=rng.choice([0, 1, 2**32 - 1]),
                        total_size=size, data=rng.randbytes(rng.choice([0, 10, 4096])))
        for _ in range(rng.choice([1, 2, 4]))
    ]  # fmt: skip


def _probe_downloads(rng: random.Random, _round: int) -> list[Any]:
    return [wire.ProbeRequest(size=rng.choice([0, 1, 1 << 20, 32 << 20, 2**32 - 1]))]


def _probe_uploads(rng: random.Random, _round: int) -> list[Any]:
    return [wire.ProbeRequest(data=rng.randbytes(rng.choice([0, 1024, 256 * 1024]))) for _ in range(rng.randint(1, 4))]


def _run_key_requests(rng: random.Random, _round: int) -> list[Any]:
    return [wire.RunKeyRequest()]


def stream_bytes(messages: list[Any]) -> bytes:
    """Protobufs as hivemind's stream client writes them: each as marker, 8-byte big-endian length and bytes, then
    the end-of-stream marker (without it a handler that takes one request waits for more)."""
    from hivemind.p2p import P2P

    def frame(marker: bytes, message: Any) -> bytes:
        body = message.SerializeToString()
        return marker + len(body).to_bytes(P2P.HEADER_LEN, P2P.BYTEORDER) + body

    return b"".join(frame(P2P.MESSAGE_MARKER, m) for m in messages) + frame(P2P.ERROR_MARKER, P2P.END_OF_STREAM)


def stream_entries(run_id: str) -> list[StreamEntry]:
    return [
        StreamEntry("blob stream (state, payload)", blob_handler_name(run_id), "all", _blob_requests),
        StreamEntry("stage messages", stage_handler_name(run_id), "stages", _stage_pieces),
        StreamEntry("bandwidth probe, download", PROBE_DOWNLOAD, "all", _probe_downloads),
        StreamEntry("bandwidth probe, upload", PROBE_UPLOAD, "all", _probe_uploads),
        StreamEntry("run-key RPC", RUN_KEY_HANDLER, "bootstrap", _run_key_requests, unary=True),
    ]


@dataclass
class Campaign:
    """The fuzzing peer: one PeerRuntime in this process, and what it sent."""

    runtime: PeerRuntime
    run_id: str
    targets: dict[str, list[Any]]  # "all", "stages", "bootstrap" -> PeerIDs
    rng: random.Random
    tallies: dict[str, EntryTally] = field(default_factory=dict)

    async def send_stream(self, entry: StreamEntry, peer: Any, round_: int, replays: list[bytes]) -> str:
        """One input to one stream handler; returns the outcome's name."""
        messages = entry.frames(self.rng, round_)
        data = messages[0].SerializeToString() if entry.unary else stream_bytes(messages)
        if self.rng.random() < 0.5:
            data = mutate_bytes(data, self.rng, replays)
        client = self.runtime.p2p._client
        if entry.unary:
            try:
                await asyncio.wait_for(client.call_unary_handler(peer, entry.handler, data), ANSWER_WAIT_S)
            except TimeoutError:
                return "held_open"
            except Exception:  # the handler's error, relayed by p2pd
                return "refused"
            return "answered"
        _, reader, writer = await client.stream_open(peer, (entry.handler,))
        try:
            with contextlib.suppress(ConnectionError):
                writer.write(data)
                await writer.drain()
            answer = await asyncio.wait_for(reader.read(READ_CAP_BYTES), ANSWER_WAIT_S)
        except TimeoutError:
            return "held_open"
        except (ConnectionError, asyncio.IncompleteReadError):
            return "refused"
        finally:
            writer.close()
        from hivemind.p2p import P2P

        return "answered" if answer[:1] == P2P.MESSAGE_MARKER else "refused"

    async def streams(self, cases: int, round_: int, progress: Callable[[int], None]) -> None:
        """`cases` inputs spread over the stream entry points and their targets, IN_FLIGHT at a time."""
        entries = stream_entries(self.run_id)
        replays = [stream_bytes(e.frames(random.Random(0), round_)) for e in entries]
        limit = asyncio.Semaphore(IN_FLIGHT)
        per_entry = max(1, cases // len(entries))

        async def one(entry: StreamEntry, peer: Any) -> None:
            async with limit:
                try:
                    outcome = await self.send_stream(entry, peer, round_, replays)
                except Exception:  # opening the stream failed: the peer refused it
                    outcome = "refused"
                tally = self.tallies[entry.name]
                setattr(tally, outcome, getattr(tally, outcome) + 1)
                tally.inputs += 1
                progress(1)

        for entry in entries:
            peers = self.targets[entry.targets]
            self.tallies[entry.name] = EntryTally()
            started = time.perf_counter()
            await asyncio.gather(*(one(entry, peers[i % len(peers)]) for i in range(per_entry)))
            self.tallies[entry.name].seconds = round(time.perf_counter() - started, 1)

    def dht(self, cases: int, progress: Callable[[int], None]) -> None:
        """`cases` signed records with one field wrong: peer records (a quarter claiming a real peer's id) and run
        announcements. A store's result only says whether some node took it; the view check afterwards counts."""
        from hivemind.utils import get_dht_time

        me = str(self.runtime.peer_id)
        real = [str(p) for p in self.targets["all"]]
        valid = record_fields(me)
        announcement = {"peer_id": me, "run_id": self.run_id, "software_version": "0.1.0",
                        "protocol_version": PROTOCOL_VERSION, "data_source": "bundled", "config": {},
                        "private": False}  # fmt: skip
        for name, sample, key in (("DHT peer records", valid, peers_key(self.run_id)),
                                  ("DHT run announcements", announcement, runs_key())):  # fmt: skip
            tally, started, futures = EntryTally(), time.perf_counter(), []
            for i in range(cases // 2):
                value = self._sendable(sample)
                if isinstance(value, dict) and i % 4 == 0:
                    value["peer_id"] = self.rng.choice(real)
                if not self.runtime.dht.is_alive():
                    raise RuntimeError("the fuzzing peer's own DHT process died; see its log")
                with self.runtime._dht_lock:
                    futures.append(self.runtime.dht.store(key, subkey=self.runtime.signer.local_public_key,
                                                          value=value, expiration_time=get_dht_time() + 60,
                                                          return_future=True))  # fmt: skip
                if len(futures) >= DHT_IN_FLIGHT:
                    self._settle(futures.pop(0), tally)
                    progress(1)
            for future in futures:
                self._settle(future, tally)
                progress(1)
            tally.seconds = round(time.perf_counter() - started, 1)
            self.tallies[name] = tally

    def _sendable(self, sample: Any) -> Any:
        """A mutation of `sample` that hivemind's DHT client can send: msgpack encodes it (not, e.g., an integer
        beyond 64 bits) in at most `MAX_STORED_BYTES`."""
        from hivemind.utils.serializer import MSGPackSerializer

        while True:
            value = mutate_structure(sample, self.rng)
            try:
                if len(MSGPackSerializer.dumps(value)) <= MAX_STORED_BYTES:
                    return value
            except (OverflowError, TypeError, ValueError):
                continue

    @staticmethod
    def _settle(future: Any, tally: EntryTally) -> None:
        tally.inputs += 1
        try:
            stored = future.result(10)
        except Exception:
            stored = False
        if stored:
            tally.answered += 1
        else:
            tally.refused += 1


class RssWatch:
    """Samples every peer's process-group RSS once a second in a thread; `peak(since)` is the largest since then."""

    def __init__(self, pgids: dict[str, int]) -> None:
        self.pgids, self.samples = pgids, []  # (monotonic time, {name: rss_mb})
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(1.0):
            self.samples.append((time.monotonic(), {n: sample_group(g)["rss_mb"] for n, g in self.pgids.items()}))

    def peak(self, start: float, end: float) -> dict[str, float]:
        window = [s for t, s in self.samples if start <= t <= end]
        return {n: round(max((s[n] for s in window), default=0.0), 1) for n in self.pgids}

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def run_swarm_fuzz(cfg: SwarmFuzzConfig, progress: Progress | None = None) -> dict[str, Any]:
    """Run the scenario; returns the report (also `out/report.json` and `report.md`)."""
    workdir = fresh_dir(cfg.out / "logs")
    with LocalSwarm(workdir) as swarm:
        boot = swarm.start_bootstrap(run_args("tiny", cfg.round_s))
        pgids = {name: swarm.start(name, peer_args(boot, name, workdir, i)).pid for i, name in enumerate(PEERS)}
        pgids["bootstrap"] = swarm.processes["bootstrap"].pid

        def swarm_round() -> int:
            return max(max(rounds_of(workdir / f"{n}.jsonl"), default=-1) for n in PEERS)

        wait_until(lambda: swarm_round() >= 2, 300, "the swarm's first rounds")
        watch = RssWatch(pgids)
        calm_from = time.monotonic()
        calm_round = swarm_round()
        wait_until(lambda: swarm_round() >= calm_round + cfg.calm_rounds, 300, "rounds without fuzzing")
        runtime = PeerRuntime([boot])
        try:
            announcement = fetch_run_announcement(runtime)
            assert announcement is not None, "the bootstrap announces no run"
            runtime.join_run(announcement.run_id, serve=False)
            records = wait_until(lambda: _all_records(runtime), 60, "every peer's record")
            targets = _targets(records, boot)
            campaign = Campaign(runtime, announcement.run_id, targets, random.Random(cfg.seed))
            task = progress.add_task("fuzzing the swarm", total=cfg.cases) if progress else None

            def advance(n: int) -> None:
                if progress is not None and task is not None:
                    progress.advance(task, n)

            fuzz_from, fuzz_round = time.monotonic(), swarm_round()
            stream_cases = cfg.cases - cfg.dht_cases
            runtime.run(campaign.streams(stream_cases, fuzz_round, advance))
            campaign.dht(cfg.dht_cases, advance)
            fuzz_to, fuzz_last = time.monotonic(), swarm_round()
            wait_until(lambda: swarm_round() >= fuzz_last + 2, 300, "rounds after fuzzing")
            view = runtime.read_records() or {}
            strangers = sorted(set(view) - {str(p) for p in targets["all"]} - {str(runtime.peer_id)})
            adopted = fetch_run_announcement(runtime)
        finally:
            runtime.shutdown()
        watch.stop()
        alive = {name: swarm.processes[name].poll() is None for name in pgids}
        exits = {name: sigterm_and_wait(swarm.processes[name]) for name in pgids}
    per_peer = {name: rounds_of(workdir / f"{name}.jsonl") for name in PEERS}
    fuzzed = range(fuzz_round + 1, fuzz_last + 1)
    calm = range(calm_round + 1, fuzz_round + 1)
    report = {
        "config": {"cases": cfg.cases, "dht_cases": cfg.dht_cases, "seed": cfg.seed, "round_s": cfg.round_s},
        "entries": {name: t.__dict__ for name, t in campaign.tallies.items()},
        "fuzz_seconds": round(fuzz_to - fuzz_from, 1),
        "rounds_fuzzed": len(fuzzed),
        "rounds_disagreeing": len(disagreeing_rounds(per_peer)),
        "contributed": {
            name: {"calm": _share(per_peer[name], calm), "fuzzed": _share(per_peer[name], fuzzed)} for name in PEERS
        },
        "alive_at_end": alive,
        "exits": exits,
        "peak_rss_mb": {"calm": watch.peak(calm_from, fuzz_from), "fuzzed": watch.peak(fuzz_from, fuzz_to)},
        "records_no_peer_wrote": strangers,
        "joiner_adopts_the_bootstraps_run": adopted is not None and adopted.run_id == announcement.run_id,
    }
    write_report(cfg.out, report, render_markdown(report))
    return report


def _share(records: dict[int, dict[str, Any]], rounds: range) -> str:
    """'contributed/completed' over `rounds`."""
    done = [records[t] for t in rounds if t in records]
    return f"{sum(1 for r in done if r.get('contributed'))}/{len(done)}"


def _all_records(runtime: PeerRuntime) -> dict[str, Any] | None:
    records = runtime.read_records() or {}
    return records if len(records) >= len(PEERS) else None


def _targets(records: dict[str, PeerRecord], bootstrap: str) -> dict[str, list[Any]]:
    """Whom each kind of entry point is sent to: every peer (bootstrap included), the stage peers, the bootstrap."""
    from hivemind.p2p import PeerID
    from hivemind.utils.multiaddr import Multiaddr

    boot = PeerID.from_base58(Multiaddr(bootstrap).value_for_protocol("p2p"))
    stages = [PeerID.from_base58(p) for p, r in records.items() if r.role == ROLE_STAGE]
    return {"all": [PeerID.from_base58(p) for p in records] + [boot], "stages": stages, "bootstrap": [boot]}


def render_markdown(report: dict[str, Any]) -> str:
    lines = [
        f"Swarm fuzz: {sum(t['inputs'] for t in report['entries'].values()):,} inputs in "
        f"{report['fuzz_seconds']} s from a peer process, {report['rounds_fuzzed']} rounds trained meanwhile.\n",
        "| entry point | inputs | answered | refused | held open (sender gave up) |",
        "|---|---|---|---|---|",
    ]
    for name, t in report["entries"].items():
        lines.append(f"| {name} | {t['inputs']:,} | {t['answered']:,} | {t['refused']:,} | {t['held_open']:,} |")
    calm, fuzzed = report["peak_rss_mb"]["calm"], report["peak_rss_mb"]["fuzzed"]
    lines += ["", "| peer | alive at end | exit | contributed calm | contributed fuzzed | peak RSS MB calm → fuzzed |",
              "|---|---|---|---|---|---|"]  # fmt: skip
    for name in report["alive_at_end"]:
        share = report["contributed"].get(name, {"calm": "–", "fuzzed": "–"})
        lines.append(f"| {name} | {report['alive_at_end'][name]} | {report['exits'][name]} | {share['calm']} | "
                     f"{share['fuzzed']} | {calm[name]} → {fuzzed[name]} |")  # fmt: skip
    lines.append(f"\nrounds in which peers disagreed: {report['rounds_disagreeing']}; records in the view no peer "
                 f"wrote: {len(report['records_no_peer_wrote'])}; a joiner afterwards adopts the bootstrap's run: "
                 f"{report['joiner_adopts_the_bootstraps_run']}")  # fmt: skip
    return "\n".join(lines) + "\n"
