"""Where a node's run definition comes from: a bootstrap's signed announcement, a `run.toml`, or the command line.

A bootstrap takes defaults < `--config run.toml` < explicit options. A joiner adopts the announced run; any run
option it set explicitly must agree with it, and its own data and tokenizer must hash to the run's identities,
so a mismatch is an error that names what differs instead of a silently separate swarm.
"""

from __future__ import annotations

import dataclasses
import logging
import time
import tomllib
import typing
from importlib.metadata import version
from pathlib import Path
from typing import Any

from hetero_node.client.config import RunOptions
from hetero_node.client.swarm.runtime import PeerRuntime
from hetero_node.models.config import ModelConfig, get_preset
from hetero_node.models.data import TokenStore, build_token_store
from hetero_node.models.paths import default_cache_dir
from hetero_node.models.tokenizer import load_tokenizer
from hetero_node.protocol.errors import ConfigError
from hetero_node.protocol.keys import RUN_KEY_HANDLER
from hetero_node.protocol.outer_specs import outer_spec
from hetero_node.protocol.proto_build import load_proto_module
from hetero_node.protocol.records import RunAnnouncement, is_sealed_announcement, parse_run_announcement
from hetero_node.protocol.run_config import (
    PROTOCOL_VERSION,
    OptimConfig,
    OuterConfig,
    PipelineConfig,
    RunConfig,
    SparseLoCoConfig,
)

logger = logging.getLogger(__name__)
wire = load_proto_module("wire")

RUN_SECTIONS: dict[str, type] = {
    "run": RunOptions,
    "outer": OuterConfig,
    "optim": OptimConfig,
    "sparseloco": SparseLoCoConfig,
    "pipeline": PipelineConfig,
}
"""`run.toml` tables and the config each fills; keys are the CLI option names with underscores."""
LOCAL_RUN_OPTIONS = {"data", "tokenizer", "cache_dir"}
"""Run options that name local files: compared through the identities they produce, not by value."""


def prepare_run(
    options: RunOptions, outer: OuterConfig, optim: OptimConfig, sparseloco: SparseLoCoConfig, pipeline: PipelineConfig
) -> tuple[RunConfig, TokenStore]:
    """Load (or build) the token store and return the run config that names it."""
    tokenizer = load_tokenizer(options.tokenizer)
    store = build_token_store(options.data, tokenizer, options.cache_dir or default_cache_dir())
    check_run_shape(options, outer, pipeline, get_preset(options.preset, vocab_size=tokenizer.vocab_size))
    run = RunConfig(
        preset=options.preset,
        vocab_size=tokenizer.vocab_size,
        batch_size=options.batch_size,
        seq_len=options.seq_len,
        seed=options.seed,
        data_shards=options.data_shards,
        data_identity=store.identity,
        tokenizer_identity=tokenizer.identity,
        outer=outer,
        optim=optim,
        sparseloco=sparseloco,
        pipeline=pipeline,
    )
    return run, store


def public_swarm_rule(outer: OuterConfig, chosen: bool, private: bool) -> OuterConfig:
    """The aggregation rule a swarm runs when its operator named none (`chosen`: an option or run.toml did):
    `robust` in a public swarm, where anyone may send well-formed lies (the mean rule let one member's whole norm on
    one row of the output head take `tiny` from 2.35 to 6.17 in six rounds; the robust rule leaves it out), the mean
    rule in a private one, whose members hold the swarm key (robust costs honest replicas much of their step: four of
    them made about half the mean rule's loss decrease in 12 lab rounds; bench/README.md, *Liars with well-formed
    messages*). DiLoCo has the mean rule only. Under `--admission loss` the mean rule stays: the judges leave out
    the steps that raise the probe loss, and robust's price for honest replicas would stay too (bench/README.md,
    *Loss-scored admission in real swarms*)."""
    sparse = outer_spec(outer.outer).sparse
    if chosen or private or not sparse or outer.aggregation == "robust" or outer.admission == "loss":
        return outer
    return dataclasses.replace(outer, aggregation="robust")


def check_run_shape(options: RunOptions, outer: OuterConfig, pipeline: PipelineConfig, model_cfg: ModelConfig) -> None:
    """ConfigError unless the batch, stages and boundary fit the model (what no dataclass can check alone)."""
    if options.seq_len > model_cfg.max_seq_len:
        raise ConfigError(f"--seq-len {options.seq_len} exceeds {options.preset}'s max_seq_len {model_cfg.max_seq_len}")
    if outer.stages > model_cfg.n_layers:
        raise ConfigError(f"--stages {outer.stages} exceeds {options.preset}'s {model_cfg.n_layers} layers")
    if pipeline.microbatches > options.batch_size:
        raise ConfigError(f"--microbatches {pipeline.microbatches} exceeds --batch-size {options.batch_size}")
    if pipeline.rank(model_cfg.d_model) > model_cfg.d_model:
        raise ConfigError(f"--subspace-rank {pipeline.subspace_rank} exceeds {options.preset}'s d_model")
    if pipeline.activation_compression == "compress-all" and outer.stages < 2:
        raise ConfigError("--activation-compression compress-all needs --stages ≥ 2 (a pipeline to compress)")


def load_run_file(path: Path) -> dict[str, dict[str, Any]]:
    """Parse a run.toml into {section: {field: value}}; unknown tables or keys are errors, not ignored typos."""
    try:
        data = tomllib.loads(path.read_text())
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as e:
        raise ConfigError(f"--config {path}: {e}") from None
    for section, values in data.items():
        if section not in RUN_SECTIONS or not isinstance(values, dict):
            raise ConfigError(f"--config {path}: unknown table [{section}]; expected {', '.join(RUN_SECTIONS)}")
        known = {f.name for f in dataclasses.fields(RUN_SECTIONS[section])}
        unknown = set(values) - known
        if unknown:
            raise ConfigError(f"--config {path}: unknown keys in [{section}]: {', '.join(sorted(unknown))}")
        _check_types(path, section, values)
    return data


def _check_types(path: Path, section: str, values: dict[str, Any]) -> None:
    """Each value must have its field's type as it is (a string where a number belongs is an error naming the key,
    before any check compares it with a number); file options are written as strings."""
    from pydantic import TypeAdapter, ValidationError

    hints = typing.get_type_hints(RUN_SECTIONS[section])
    for key, value in values.items():
        expected = str if key in LOCAL_RUN_OPTIONS else hints[key]
        try:
            TypeAdapter(expected).validate_python(value, strict=True)
        except ValidationError as e:
            reason = e.errors()[0]["msg"].lower()
            raise ConfigError(f"--config {path}: [{section}] {key} = {value!r}: {reason}") from None


def apply_run_file(configs: dict[str, Any], run_file: dict[str, dict[str, Any]], explicit: set[str]) -> dict[str, Any]:
    """Configs with the file's values, except where an option was given explicitly on the command line."""
    merged = {}
    for section, config in configs.items():
        values = {
            k: Path(v) if k in LOCAL_RUN_OPTIONS else v
            for k, v in run_file.get(section, {}).items()
            if k not in explicit
        }
        try:
            merged[section] = dataclasses.replace(config, **values)
        except TypeError as e:
            raise ConfigError(f"run file [{section}]: {e}") from None
    return merged


def _explicit_conflicts(run: RunConfig, configs: dict[str, Any], explicit: set[str]) -> list[str]:
    """Explicit options whose value differs from the announced run's."""
    announced = {
        "run": run, "outer": run.outer, "optim": run.optim, "sparseloco": run.sparseloco, "pipeline": run.pipeline,
    }  # fmt: skip
    conflicts = []
    for section, config in configs.items():
        for f in dataclasses.fields(config):
            if f.name not in explicit or f.name in LOCAL_RUN_OPTIONS:
                continue
            mine, theirs = getattr(config, f.name), getattr(announced[section], f.name)
            if mine != theirs:
                conflicts.append(f"--{f.name.replace('_', '-')} {mine} (the swarm's run uses {theirs})")
    return conflicts


def _check_versions(protocol_version: Any, software_version: Any) -> None:
    """ConfigError naming the version to install when the swarm's protocol or release differs from ours."""
    ours = version("hetero-node")
    if protocol_version != PROTOCOL_VERSION:
        raise ConfigError(
            f"the swarm speaks protocol {protocol_version}, this hetero-node {ours} speaks "
            f"{PROTOCOL_VERSION}: install hetero-node {software_version}"
        )
    if str(software_version).split(".")[:2] != ours.split(".")[:2]:
        raise ConfigError(f"the swarm runs hetero-node {software_version}, this is {ours}: install that version")


def adopt_announced_run(
    announcement: RunAnnouncement, configs: dict[str, Any], explicit: set[str]
) -> tuple[RunConfig, TokenStore]:
    """The announced run plus this node's token store, after every check in the module docstring."""
    _check_versions(announcement.protocol_version, announcement.software_version)
    run = RunConfig.from_dict(announcement.config)
    if run.run_id != announcement.run_id:
        raise ConfigError(f"the announced config hashes to {run.run_id}, not to its run id {announcement.run_id}")
    conflicts = _explicit_conflicts(run, configs, explicit)
    if conflicts:
        raise ConfigError("your options differ from the swarm's run: " + "; ".join(conflicts))
    options = dataclasses.replace(
        configs["run"], preset=run.preset, batch_size=run.batch_size, seq_len=run.seq_len, seed=run.seed,
        data_shards=run.data_shards,
    )  # fmt: skip
    mine, store = prepare_run(options, run.outer, run.optim, run.sparseloco, run.pipeline)
    differences = []
    if mine.tokenizer_identity != run.tokenizer_identity:
        differences.append(f"tokenizer identity {mine.tokenizer_identity} (the run's: {run.tokenizer_identity})")
    if mine.data_identity != run.data_identity:
        differences.append(
            f"data identity {mine.data_identity} (the run trains on {announcement.data_source}: {run.data_identity})"
        )
    if differences:
        raise ConfigError("your data does not match the swarm's run: " + "; ".join(differences))
    logger.info("adopted run %s announced by %s", run.run_id, announcement.peer_id)
    return run, store


def fetch_run_announcement(runtime: PeerRuntime, timeout_s: float = 15.0) -> RunAnnouncement | None:
    """The run announced by the first `--peers` entry that announces one; None if none does (a stock hivemind-dht).

    The peer tells us its signing key over libp2p (which authenticates its peer id); only the DHT record signed
    by that key is accepted, so another peer cannot slip in a different run.
    """
    import asyncio

    from hivemind.p2p import PeerID
    from hivemind.utils.multiaddr import Multiaddr

    for maddr in runtime.initial_peers:
        peer_id = PeerID.from_base58(Multiaddr(maddr).value_for_protocol("p2p"))
        request = runtime.p2p.call_protobuf_handler(peer_id, RUN_KEY_HANDLER, wire.RunKeyRequest(), wire.RunKeyReply)
        try:
            reply = runtime.run(asyncio.wait_for(request, 5.0))
        except Exception as e:  # no handler (a plain DHT peer) or unreachable: try the next address
            logger.info("%s announces no run (%r)", peer_id, e)
            continue
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            found = runtime.read_run_announcements() or {}
            if reply.public_key in found:
                raw = found[reply.public_key]
                announcement = parse_run_announcement(raw, runtime.swarm_key)
                if announcement is None and is_sealed_announcement(raw):
                    raise ConfigError(
                        "this swarm is private: pass --swarm-key FILE with the key its operator gave you"
                        if runtime.swarm_key is None
                        else "--swarm-key: this swarm's run announcement does not open with that key (another swarm's?)"
                    )
                if announcement is None:  # an older or newer release's announcement says which one it is
                    if isinstance(raw, dict):
                        _check_versions(raw.get("protocol_version"), raw.get("software_version"))
                    raise ConfigError(f"{peer_id} announces its run in a form this hetero-node cannot read")
                return announcement
            time.sleep(0.5)
        raise ConfigError(f"{peer_id} runs {reply.run_id} but its signed run announcement is not in the DHT")
    return None


def data_source_name(options: RunOptions) -> str:
    """What a bootstrap tells joiners its data is (they must have the same bytes themselves)."""
    return "the bundled corpus" if options.data is None else f"the file {options.data.name}"
