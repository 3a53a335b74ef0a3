"""Single-process tests of the node's pieces: run identity, record identity, group agreement rule, checkpoints, peer
addresses."""

from __future__ import annotations

import dataclasses
import logging
import os
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
import torch
from factories import record_fields, run_config
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.p2p import PeerID

from hetero_node.client.cli.demo import DemoConfig, summarize
from hetero_node.client.cli.demo import run_args as demo_run_args
from hetero_node.client.node.capabilities import measure_stage_throughput, measure_throughput
from hetero_node.client.node.join import role_for_run, timed_stage
from hetero_node.client.node.run_definition import public_swarm_rule
from hetero_node.client.outer.shard_state import transfer_timeout
from hetero_node.client.outer.shard_sync import majority_fingerprint
from hetero_node.client.roles.checkpoint import CHECKPOINT_NAME, CheckpointWriter, load_checkpoint, save_checkpoint
from hetero_node.client.roles.stage_peer import table_donors
from hetero_node.client.swarm.addresses import parse_peer_multiaddrs
from hetero_node.client.swarm.cost_model import RunShape
from hetero_node.client.swarm.planner import Requirements
from hetero_node.client.swarm.record_reader import MAX_RECORD_LIFETIME_S, latest_valid_records
from hetero_node.client.swarm.work_ledger import WorkLedger
from hetero_node.protocol.errors import CheckpointError, ConfigError, PeerAddressError
from hetero_node.protocol.identity import create_identity, load_identity, owner_peer_id
from hetero_node.protocol.run_config import OuterConfig, PipelineConfig, RunConfig, SparseLoCoConfig


def run_requirements(run: RunConfig) -> Requirements:
    """What `join` gives its planner for this run."""
    from hetero_node.client.swarm.auto_plan import requirements
    from hetero_node.client.swarm.cost_model import RunShape

    return requirements(RunShape.from_run(run))


PEER = "/ip4/127.0.0.1/tcp/31337/p2p/12D3KooWHa9cH8vUkHcsdSAKZc1bBnvPwoiTVCjz79SDJhGCe3Ty"


@pytest.mark.parametrize(("exponent", "bits"), [(3, 2048), (65537, 1024)])
def test_a_non_standard_rsa_key_owns_no_record_and_is_no_identity(tmp_path: Path, exponent: int, bits: int) -> None:
    """Ids from grinding the exponent of one modulus (or from short keys) cost no key generation each: refused."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import rsa
    from hivemind.proto import crypto_pb2
    from hivemind.utils.crypto import RSAPrivateKey

    odd = RSAPrivateKey.__new__(RSAPrivateKey)
    odd._private_key = rsa.generate_private_key(public_exponent=exponent, key_size=bits)
    assert owner_peer_id(RSASignatureValidator(odd).local_public_key) is None
    der = odd._private_key.private_bytes(
        serialization.Encoding.DER, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    path = tmp_path / "odd.id"
    path.write_bytes(crypto_pb2.PrivateKey(key_type=crypto_pb2.KeyType.RSA, data=der).SerializeToString())
    with pytest.raises(ConfigError, match="exponent 65537 and at least 2048 bits"):
        load_identity(path)
    standard = RSASignatureValidator(RSAPrivateKey()).local_public_key  # what hivemind generates
    assert owner_peer_id(standard) is not None


def test_a_record_counts_only_when_signed_by_the_key_of_the_peer_id_it_claims(tmp_path: Path) -> None:
    paths = [tmp_path / "a.id", tmp_path / "b.id"]
    for path in paths:
        create_identity(path)
    sub_a, sub_b = (RSASignatureValidator(load_identity(path)).local_public_key for path in paths)
    id_a = PeerID.from_identity(paths[0].read_bytes()).to_base58()  # what p2pd makes of the same file
    assert owner_peer_id(sub_a) == id_a and owner_peer_id(sub_b) not in (None, id_a)
    assert owner_peer_id(b"[owner:ssh-rsa AAAA]") is None and owner_peer_id("[owner:x]") is None

    now = 1000.0
    forged = record_fields(id_a, role="full", memory_gb=999.0, written_at=now)
    fresh = record_fields(id_a, written_at=now - 1.0, refresh_s=5.0)
    records = latest_valid_records({sub_a: (fresh, now + 10), sub_b: (forged, now + 1e9)}, now)
    assert set(records) == {id_a} and records[id_a][0].role == "joining" and records[id_a][1] == now + 10
    far = latest_valid_records({sub_a: (fresh, now + 1e9)}, now)
    assert far[id_a][1] == now - 1.0 + 3 * 5.0  # its writer's far expiration does not count: 3 refreshes do
    for written_at in (now - 3 * 5.0 - 1, now - MAX_RECORD_LIFETIME_S - 1, now + MAX_RECORD_LIFETIME_S + 1):
        stale = record_fields(id_a, written_at=written_at, refresh_s=5.0)  # stored once long ago, or dated ahead
        assert latest_valid_records({sub_a: (stale, now + 1e9)}, now) == {}
    slow = record_fields(id_a, written_at=now - 500.0, refresh_s=3600.0)  # a huge refresh is capped at 10 min
    assert latest_valid_records({sub_a: (slow, now + 1e9)}, now)[id_a][1] == now - 500.0 + MAX_RECORD_LIFETIME_S
    id_b = PeerID.from_identity(paths[1].read_bytes()).to_base58()
    both = {sub_a: (fresh, now + 10), sub_b: (record_fields(id_b, written_at=now), now + 10)}
    assert set(latest_valid_records(both, now)) == {id_a, id_b}
    ledger = WorkLedger()
    assert set(latest_valid_records({sub_a: both[sub_a]}, now - 5, ledger=ledger)) == {id_a}
    assert set(latest_valid_records(both, now, limit=1, ledger=ledger)) == {id_a}  # over the cap: the incumbent
    ledger.note_work([id_b], now)
    assert set(latest_valid_records(both, now, limit=1, ledger=ledger)) == {id_b}  # ...unless the other worked


def test_an_identity_file_that_is_not_a_libp2p_rsa_key_is_a_clear_error(tmp_path: Path) -> None:
    bad = tmp_path / "node.id"
    bad.write_bytes(b"not a key")
    with pytest.raises(ConfigError, match="is not a libp2p RSA identity"):
        load_identity(bad)


def test_run_id_is_stable_and_covers_every_setting() -> None:
    assert run_config().run_id == run_config().run_id
    variants = [
        run_config(seed=1),
        run_config(data_identity="e" * 64),
        run_config(tokenizer_identity="u" * 64),
        run_config(outer=OuterConfig(inner_steps=31)),
        run_config(outer=OuterConfig(outer="diloco")),
        run_config(sparseloco=SparseLoCoConfig(topk=32)),
    ]
    ids = {v.run_id for v in variants} | {run_config().run_id}
    assert len(ids) == len(variants) + 1, "two different runs would share averaging groups"


def test_majority_fingerprint_is_the_same_for_every_member_and_a_tie_needs_outside_evidence() -> None:
    assert majority_fingerprint(["b", "a", "b"]) == "b"
    # a liar claiming the smallest fingerprint does not win a group of two (H1): nobody is included ...
    assert majority_fingerprint(["b", "0" * 32]) == majority_fingerprint(["0" * 32, "b"]) == ""
    # ... unless the swarm's records vouch for one side of the tie
    assert majority_fingerprint(["0" * 32, "b"], vouched=lambda: "b") == "b"
    assert majority_fingerprint(["0" * 32, "b"], vouched=lambda: "c") == ""
    assert majority_fingerprint(["a", "b", "b", "a", "c"], vouched=lambda: "a") == "a"


def test_checkpoint_round_trip_and_refusals(tmp_path: Path) -> None:
    state = {"run_id": "abc", "round": 3, "model": {"w": torch.arange(4.0)}}
    save_checkpoint(tmp_path, state)
    loaded = load_checkpoint(tmp_path, "abc")
    assert loaded["round"] == 3 and torch.equal(loaded["model"]["w"], state["model"]["w"])
    assert list(tmp_path.iterdir()) == [tmp_path / CHECKPOINT_NAME], "no temporary file left behind"

    with pytest.raises(CheckpointError, match="belongs to run abc"):
        load_checkpoint(tmp_path, "other-run")

    path = tmp_path / CHECKPOINT_NAME
    good = path.read_bytes()
    path.write_bytes(good[: len(good) // 2])
    with pytest.raises(CheckpointError, match=f"{path} is corrupt"):
        load_checkpoint(tmp_path, "abc")
    flipped = bytearray(good)
    flipped[-40] ^= 0x01  # inside the tensor data: it would still parse
    path.write_bytes(bytes(flipped))
    with pytest.raises(CheckpointError, match="checksum does not match"):
        load_checkpoint(tmp_path, "abc")
    path.write_bytes(b"PK\x03\x04" + good[4:])
    with pytest.raises(CheckpointError, match="not a hetero-node replica checkpoint"):
        load_checkpoint(tmp_path, "abc")
    path.write_bytes(b"hetero-node checkpoint 2\n" + b"a pickle of an older version")
    with pytest.raises(CheckpointError, match=r"another hetero-node version \(format 2, .*move it away"):
        load_checkpoint(tmp_path, "abc")
    save_checkpoint(tmp_path, {**state, "model": {"w": torch.tensor([1.0, float("nan")])}})
    with pytest.raises(CheckpointError, match="non-finite"):
        load_checkpoint(tmp_path, "abc")
    assert load_checkpoint(tmp_path / "missing", "abc") is None


def test_the_background_writer_writes_the_latest_snapshot_taken_when_saved_and_survives_a_refusal(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    weights = torch.arange(4.0)
    writer = CheckpointWriter(tmp_path)
    try:
        writer.save({"run_id": "abc", "round": 3, "model": {"w": weights}})
        weights.add_(10.0)  # training goes on writing into the live tensor: the snapshot must not see it
        writer.save({"run_id": "abc", "round": 4, "model": {"w": weights}, "trainer": {"step": [weights]}})
        weights.add_(10.0)
        writer.flush()
        loaded = load_checkpoint(tmp_path, "abc")
        assert loaded["round"] == 4 and torch.equal(loaded["model"]["w"], torch.arange(4.0) + 10)
        blocked = tmp_path / "not-a-directory"
        blocked.write_text("a file where the checkpoint directory should be")
        refused = CheckpointWriter(blocked)
        refused.save({"run_id": "abc", "round": 5, "model": {}})
        refused.close()  # logged, not raised: a full or broken disk must not end training
        assert "could not write checkpoint" in caplog.text
        writer.save({"run_id": "abc", "round": 6, "model": {"w": weights}})
    finally:
        writer.close()  # writes what is pending before returning
    assert load_checkpoint(tmp_path, "abc")["round"] == 6


def test_a_state_download_gets_the_time_its_size_needs_on_this_nodes_link() -> None:
    assert transfer_timeout(1_000_000, 100.0, 30.0) == 30.0  # 0.16 s needed: the floor
    assert transfer_timeout(454_000_000, 50.0, 30.0) == pytest.approx(145.28)  # a 178m shard on 50 Mbit/s
    assert transfer_timeout(454_000_000, 0.0, 30.0) == 30.0  # bandwidth unknown


def test_a_full_disk_keeps_the_previous_checkpoint_and_leaves_no_temporary_file(tmp_path: Path) -> None:
    disk = tmp_path / "disk"
    disk.mkdir()
    mount = ["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(disk)]
    if os.geteuid() != 0 or subprocess.run(mount, capture_output=True).returncode != 0:
        pytest.skip("needs root to mount a 256 KB tmpfs (a disk that fills up)")
    try:
        state = {"run_id": "abc", "round": 3, "model": {"w": torch.arange(4.0)}}
        save_checkpoint(disk, state)
        (disk / "replica.tmp999999").write_bytes(b"left by a writer killed mid-write")
        with pytest.raises(CheckpointError, match=r"could not write checkpoint .*No space left"):
            save_checkpoint(disk, {**state, "round": 4, "model": {"w": torch.zeros(1 << 18)}})  # 1 MB
        assert load_checkpoint(disk, "abc")["round"] == 3
        assert sorted(p.name for p in disk.iterdir()) == [CHECKPOINT_NAME]
    finally:
        subprocess.run(["umount", str(disk)], check=False)


@pytest.mark.parametrize("bad", ["garbage", "/ip4/127.0.0.1/tcp/31337", "/ip4/999.0.0.1/tcp/1/p2p/x", ""])
def test_malformed_peer_addresses_are_refused(bad: str) -> None:
    with pytest.raises(PeerAddressError, match=r"is not a peer multiaddr|lacks the /p2p/<peer id> part"):
        parse_peer_multiaddrs([bad])
    assert parse_peer_multiaddrs([PEER]) == [PEER]


def test_join_with_a_bad_address_fails_fast_with_one_line(tmp_path: Path) -> None:
    started = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-m", "hetero_node.client.cli", "join", "--peers", "/ip4/1.2.3.4/tcp/5", "--preset", "tiny"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 1
    assert "error: '/ip4/1.2.3.4/tcp/5' lacks the /p2p/<peer id> part" in result.stderr
    assert "Traceback" not in result.stderr
    assert time.monotonic() - started < 60


def test_join_through_an_unreachable_bootstrap_is_a_clear_error() -> None:
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "hetero_node.client.cli",
            "join",
            "--peers",
            PEER.replace("31337", "1"),
            "--preset",
            "tiny",
        ],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert result.returncode == 1
    said = f"error: no peer answered at {PEER.replace('31337', '1')}: check that the bootstrap is running"
    assert said in result.stderr
    assert "Daemon failed to start" not in result.stderr and "Traceback" not in result.stderr


def test_status_view_shows_peers_missing_stages_and_agreement() -> None:
    from rich.console import Console

    from hetero_node.client.cli.status import render

    peer = {
        "peer_id": "QmcgHdjLUSS8Y13rwEVKo1jv1C1jsGagSLEqoc36YMKx4Z", "role": "stage", "vr": 0, "stage": 1,
        "gpus": [{"name": "RTX 3060", "memory_gb": 12.0}], "devices": 1, "cpu_cores": 8, "memory_gb": 11.5,
        "upload_mbps": 48.0, "rtt_ms": 83.9,
        "download_mbps": 95.0, "tokens_per_s": 0.0, "round": 3, "loss": 3.25, "last_seen_s": 2.0, "view": "ab",
    }  # fmt: skip
    snapshot = {
        "run_id": "0123456789abcdef", "run": None, "round": 3, "peers": [peer],
        "virtual_replicas": {"0": {"stages": {"1": peer["peer_id"]}, "missing": [0]}}, "views_agree": True,
    }  # fmt: skip
    console = Console(width=160, record=True)
    console.print(render(snapshot))
    text = console.export_text()
    assert peer["peer_id"] not in text and "36YMKx4Z" in text and "RTX 3060" in text and "48/95" in text
    assert "rtt ms" in text and "│     84 │" in text  # the round trip to the bootstrap its record gives
    assert "missing stages" in text and "│ 0  " in text and "see the same plan: yes" in text
    marked = {**snapshot, "peers": [{**peer, "gpus": [{"name": "[/bold]", "memory_gb": 1.0}]}]}
    console.print(render(marked))  # a peer's GPU name is text, never markup (it once crashed the view)
    assert "[/bold]" in console.export_text()
    server = {
        **snapshot,
        "peers": [{**peer, "role": "full", "devices": 8, "gpus": [{"name": "H100", "memory_gb": 80.0}]}],
    }
    console.print(render(server))  # one replica on 8 GPUs: one row
    assert "8× H100" in console.export_text()


def test_run_file_fills_the_run_definition_and_explicit_options_win(tmp_path: Path) -> None:
    from hetero_node.client.config import RunOptions
    from hetero_node.client.node.run_definition import apply_run_file, load_run_file
    from hetero_node.protocol.run_config import OptimConfig, OuterConfig, SparseLoCoConfig

    run_file = tmp_path / "run.toml"
    run_file.write_text('[run]\npreset = "tiny"\nseq_len = 64\n[outer]\ninner_steps = 12\n[optim]\nlr = 0.001\n')
    configs = {"run": RunOptions(seq_len=32), "outer": OuterConfig(), "optim": OptimConfig(),
               "sparseloco": SparseLoCoConfig()}  # fmt: skip
    merged = apply_run_file(configs, load_run_file(run_file), explicit={"seq_len"})
    assert merged["run"].preset == "tiny" and merged["run"].seq_len == 32  # the command line wins
    assert merged["outer"].inner_steps == 12 and merged["optim"].lr == 0.001

    run_file.write_text("[outer]\ninner_step = 12\n")
    with pytest.raises(ConfigError, match=r"unknown keys in \[outer\]: inner_step"):
        load_run_file(run_file)
    run_file.write_text("[model]\npreset = 'tiny'\n")
    with pytest.raises(ConfigError, match=r"unknown table \[model\]"):
        load_run_file(run_file)
    run_file.write_text("[outer]\ninner_steps = 0\n")
    with pytest.raises(ConfigError, match="--inner-steps must be positive"):
        apply_run_file(configs, load_run_file(run_file), explicit=set())
    run_file.write_text("[outer]\nouter = 'diloco'\naggregation = 'robust'\n")
    with pytest.raises(ConfigError, match="--outer diloco has only the mean rule"):
        apply_run_file(configs, load_run_file(run_file), explicit=set())
    run_file.write_text("[outer]\naggregation = 'median'\n")
    with pytest.raises(ConfigError, match="--aggregation must be one of mean, robust"):
        apply_run_file(configs, load_run_file(run_file), explicit=set())


def test_a_public_swarm_aggregates_robustly_unless_its_operator_chose_a_rule_or_it_is_private() -> None:
    default = OuterConfig()
    assert default.aggregation == "mean"
    assert public_swarm_rule(default, chosen=False, private=False).aggregation == "robust"
    assert public_swarm_rule(default, chosen=True, private=False).aggregation == "mean"  # --aggregation mean
    assert public_swarm_rule(default, chosen=False, private=True).aggregation == "mean"  # members hold the key
    diloco = OuterConfig(outer="diloco")
    assert public_swarm_rule(diloco, chosen=False, private=False) == diloco  # DiLoCo has the mean rule only
    judged = OuterConfig(admission="loss")
    assert public_swarm_rule(judged, chosen=False, private=False).aggregation == "mean"  # the judges guard it


def test_compress_all_makes_every_node_a_stage_and_one_stage_runs_have_none() -> None:
    compress_all = dataclasses.replace(run_config(), pipeline=PipelineConfig(activation_compression="compress-all"))
    assert role_for_run(compress_all, "auto") == role_for_run(compress_all, "stage") == "stage"
    with pytest.raises(ConfigError, match="compress-all"):
        role_for_run(compress_all, "full")
    one_stage = dataclasses.replace(run_config(), outer=OuterConfig(stages=1))
    with pytest.raises(ConfigError, match="one stage"):
        role_for_run(one_stage, "stage")
    assert role_for_run(one_stage, "auto") == "auto"


def test_a_node_on_several_devices_trains_a_full_replica() -> None:
    assert role_for_run(run_config(), "auto", devices=2) == role_for_run(run_config(), "full", devices=2) == "full"
    with pytest.raises(ConfigError, match="one full replica across them"):
        role_for_run(run_config(), "stage", devices=2)
    compress_all = dataclasses.replace(run_config(), pipeline=PipelineConfig(activation_compression="compress-all"))
    with pytest.raises(ConfigError, match="pass --device instead"):
        role_for_run(compress_all, "auto", devices=2)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"full": 0, "virtual": 0}, "at least one replica"),
        ({"virtual": 1, "stages": 1}, "stages ≥ 2"),
        ({"activation_compression": "compress-all"}, "--full 0"),
    ],
)
def test_demo_rejects_impossible_topologies(changes: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        DemoConfig(**changes)


def test_the_demo_names_its_rule_so_its_bootstrap_does_not_take_a_public_swarms_default() -> None:
    argv = demo_run_args(DemoConfig())
    assert argv[argv.index("--aggregation") + 1] == "mean"  # given even at the field's default
    robust = demo_run_args(DemoConfig(aggregation="robust"))
    assert robust[robust.index("--aggregation") + 1] == "robust"


def test_demo_summary_counts_pipeline_bytes_and_per_shard_agreement() -> None:
    def record(round_: int, fps: dict[str, str], **extra: object) -> dict[str, object]:
        return {"round": round_, "tokens": 1000, "train_loss": 3.0, "eval_loss": None, "bytes_sent": 10,
                "dense_allreduce_bytes": 0, "compute_s": 1.0, "comm_s": 0.5, "fingerprints": fps,
                "boundary_bytes_sent": 0, **extra}  # fmt: skip

    fps = {"0": "a", "1": "b", "fixed": "c"}
    report = {
        "run": {"stages": 2, "d_model": 128, "boundary_wire": "bf16", "vocab_size": 256},
        "peers": [
            {"role": "full", "stage": None, "rounds": [record(0, fps, eval_loss=4.0), record(1, fps, eval_loss=3.5)]},
            {"role": "stage", "stage": 0, "rounds": [record(0, {"0": "a", "fixed": "c"}, boundary_bytes_sent=34_000),
                                                     record(1, {"0": "X", "fixed": "c"}, boundary_bytes_sent=34_000)]},
            {"role": "stage", "stage": 1, "rounds": [record(0, {"1": "b", "fixed": "c"}, boundary_bytes_sent=32_000),
                                                     record(1, {"1": "b", "fixed": "c"}, boundary_bytes_sent=32_000)]},
        ],
    }  # fmt: skip
    summary = summarize(report)
    assert summary["rounds"] == 2 and summary["rounds_with_agreeing_fingerprints"] == 1  # shard 0 split in round 1
    assert summary["boundary_bytes_per_token"] == 66.0  # (34 000 + 32 000) bytes per 1000 tokens the VR trained
    assert summary["boundary_bytes_per_token_dense"] == 2 * 128 * 2 + 2  # bf16 both ways plus a u16 id
    assert summary["eval_loss_last_round"] == 3.5


def test_run_requirements_count_the_tables_a_subspace_run_keeps() -> None:
    """T_fixed on every peer's device (stages without the embedding keep their copy of E_S in host RAM)."""
    from hetero_node.models.memory import HEADROOM

    subspace = run_requirements(run_config())
    dense = run_requirements(run_config(pipeline=PipelineConfig(activation_compression="none")))
    table = int(HEADROOM * 4 * 256 * 128)  # tiny: byte-level vocab × d_model, fp32
    assert subspace.full_memory_bytes - dense.full_memory_bytes == table
    assert [a - b for a, b in zip(subspace.stage_memory_bytes, dense.stage_memory_bytes, strict=True)] == [table] * 2


def test_run_requirements_size_round_traffic_with_the_runs_own_outer_method() -> None:
    from hetero_node.models.config import get_preset

    n_params = get_preset("tiny").n_params()
    sparse = run_requirements(run_config()).replica_round_bytes
    dense = run_requirements(run_config(outer=OuterConfig(outer="diloco"))).replica_round_bytes
    assert dense == 4 * n_params + 2 * 10  # fp32 values of both shards, each behind a 10-byte header
    assert 100 < dense / sparse < 200  # SparseLoCo's 0.219 bits per parameter against 32
    # K bounds SparseLoCo's messages only: a DiLoCo round aggregates every contributor's dense Δ
    assert run_requirements(run_config(outer=OuterConfig(max_contributors=4))).max_contributors == 4
    assert run_requirements(run_config(outer=OuterConfig(outer="diloco", max_contributors=4))).max_contributors == 0


def test_an_ahead_of_time_import_that_fails_is_logged_at_debug_not_raised(caplog: pytest.LogCaptureFixture) -> None:
    """CI: a joiner refused at once (a mismatched run) exited while its background thread imported torch._dynamo,
    and the half-torn-down import printed a traceback into a log whose error should be one line."""
    from hetero_node.client.node.join import import_quietly

    with caplog.at_level(logging.DEBUG, logger="hetero_node.client.node.join"):
        import_quietly(("json", "hetero_node_no_such_module", "csv"))  # stops at the failure, raises nothing
    assert "importing hetero_node_no_such_module ahead of time stopped" in caplog.text


def test_a_node_too_small_for_the_model_times_the_stage_it_would_hold_as_the_whole_models_speed() -> None:
    """What the planner prices a pipeline of home nodes with: each stage's speed, scaled by its share of the FLOPs,
    lands near the whole model's on the same device (unscaled, a quarter-model stage would look 4× faster). The heaviest
    stage a node fits is the one it times; a pin, its pinned stage."""
    run = run_config(inner_steps=20)
    run = dataclasses.replace(run, outer=dataclasses.replace(run.outer, stages=4))
    shape, cpu = RunShape.from_run(run), torch.device("cpu")
    full = max(measure_throughput(run, cpu, steps=3) for _ in range(3))  # a hiccup only slows: the best of three
    for stage in range(4):
        share = shape.stage_compute_share[stage]
        scaled = max(measure_stage_throughput(run, cpu, stage, share, steps=3) for _ in range(3))
        assert full / 2 < scaled < 2 * full, (stage, scaled, full)
    everything = max(shape.stage_memory_bytes)
    assert timed_stage(shape, everything, -1) == 3  # the last stage carries the head: the most FLOPs
    assert timed_stage(shape, everything, 1) == 1 and timed_stage(shape, 0, -1) is None


def test_a_later_stage_asks_fast_donors_for_the_table_change_each_fetcher_in_its_own_order() -> None:
    """A home stage 0 (40 Mbit/s) serving its pipeline's later stages held them up for its upload: they ask the
    datacenter nodes first, spread over them, and the slow ones only after; slow as judged among the shard-0
    holders, even where home later stages that already hold the table are most of the donors."""
    holders = {f"dc-{i}": 10_000.0 for i in range(8)} | {f"home-{i}": 40.0 for i in range(6)}
    donors = holders | {f"later-{i}": 20.0 for i in range(30)}  # most donors at home: no quartile of theirs is fast
    firsts: Counter[str] = Counter()
    for fetcher in range(64):
        order = table_donors(donors, holders, f"stage-{fetcher}")
        assert sorted(order) == sorted(donors)
        assert all(pid.startswith("dc-") for pid in order[:8])  # every fast donor before any slow one
        firsts[order[0]] += 1
    assert len(firsts) == 8 and max(firsts.values()) <= 20  # the first asked is spread over the fast donors
    alike = {f"home-{i}": 40.0 for i in range(6)}
    assert {table_donors(alike, alike, f"stage-{f}")[0] for f in range(64)} == set(alike)  # nobody slow: all spread
