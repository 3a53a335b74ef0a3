"""The `hetero-node` command line (Typer).

Module import stays light (no torch, no hivemind) so `hetero-node --help` answers at once; each command imports
what it runs. User-causable errors (`HeteroNodeError`) are turned into one red line in `main`, the console
script's entry point, and nowhere else.
"""

from __future__ import annotations

import dataclasses
import json
import signal
from enum import StrEnum
from functools import partial
from pathlib import Path

import typer

from hetero_node.bootstrap.config import BootstrapConfig, RelayConfig
from hetero_node.client.cli.demo import DemoConfig
from hetero_node.client.cli.entry import command_line, console, err_console, format_value, print_plain, run
from hetero_node.client.cli.options import expand_dataclass_options, explicit_options
from hetero_node.client.cli.plan import PlanConfig
from hetero_node.client.config import NodeConfig, OptimConfig, RunOptions, SyncTimeouts, TrainConfig
from hetero_node.client.roles.metrics import RoundRecord
from hetero_node.models.paths import default_cache_dir
from hetero_node.protocol.errors import ConfigError, HeteroNodeError
from hetero_node.protocol.roles import REQUESTED_ROLES
from hetero_node.protocol.run_config import OuterConfig, PipelineConfig, SparseLoCoConfig

PROG_NAME = "hetero-node"
VOLUNTEER, OPERATOR, TRY = "Join a swarm", "Run a swarm", "Try and inspect"

app = command_line(
    PROG_NAME,
    "Volunteer compute for heterogeneous, low-bandwidth LLM pre-training over hivemind.",
    panels=(VOLUNTEER, OPERATOR, TRY),
)
data_app = typer.Typer(
    help="The training corpus: fetch it once, then every run trains offline.",
    no_args_is_help=True,
    rich_markup_mode=None,
)
app.add_typer(data_app, name="data", rich_help_panel=TRY)


@app.command(rich_help_panel=TRY)
@expand_dataclass_options
def train(
    cfg: TrainConfig,
    optim: OptimConfig,
    report: Path | None = typer.Option(None, "--report", help="Also write the run summary to this JSON file."),
) -> None:
    """Train a model in this process alone: the quality baseline, and a check that this machine works."""
    from hetero_node.client.cli.progress import print_table, train_summary_rows, training_progress
    from hetero_node.client.roles.local_train import run_local_training  # torch: imported only when it is needed

    if report is not None and not report.parent.is_dir():  # fail now, not after the whole run
        raise ConfigError(f"--report {report}: directory {report.parent} does not exist")
    with training_progress(err_console, f"train {cfg.preset}") as on_progress:
        summary = run_local_training(cfg, optim, on_progress)
    print_table(console, "local training", ("", ""), train_summary_rows(summary))
    if report is not None:
        report.write_text(json.dumps(dataclasses.asdict(summary), indent=2) + "\n")
        print_plain(f"report written to {report}")


@data_app.command("fetch")
def data_fetch(
    cache_dir: Path | None = typer.Option(
        None, "--cache-dir", help="Where to keep it (default: $HETERO_NODE_CACHE or ~/.cache/hetero-node)."
    ),
) -> None:
    """Download the bundled corpus (sha256-verified) and tokenize it, so the first training run starts at once."""
    from hetero_node.models.corpus import fetch_bundled_corpus
    from hetero_node.models.data import build_token_store
    from hetero_node.models.tokenizer import load_tokenizer

    cache_dir = cache_dir or default_cache_dir()
    with err_console.status("fetching and tokenizing the bundled corpus"):
        archive = fetch_bundled_corpus(cache_dir)
        store = build_token_store(None, load_tokenizer(None), cache_dir)
    for line in (
        f"bundled corpus: {archive}",
        f"token cache: {store.n_tokens:,} byte-level tokens under {cache_dir / 'tokens'}",
        f"data identity: {store.identity}",
    ):
        print_plain(line)


def main() -> None:
    """The `hetero-node` console script."""
    run(app)


Role = StrEnum("Role", {name.upper(): name for name in REQUESTED_ROLES})
"""--role's choices, spelled as the records spell them."""


def _run_configs(
    context: typer.Context,
    run_options: RunOptions,
    outer: OuterConfig,
    optim: OptimConfig,
    sparseloco: SparseLoCoConfig,
    pipeline: PipelineConfig,
    config: Path | None,
) -> tuple[dict[str, object], set[str], set[str]]:
    """The run definition from defaults, `--config run.toml` and explicit options (which win), which options were
    explicit, and which the operator chose (explicit, or set in the run file)."""
    from hetero_node.client.node.run_definition import apply_run_file, load_run_file

    explicit = explicit_options(context)
    configs: dict[str, object] = {
        "run": run_options, "outer": outer, "optim": optim, "sparseloco": sparseloco, "pipeline": pipeline,
    }  # fmt: skip
    if config is None:
        return configs, explicit, explicit
    run_file = load_run_file(config)
    in_file = {key for table in run_file.values() for key in table}
    return apply_run_file(configs, run_file, explicit), explicit, explicit | in_file


def _lend_relay(relay: RelayConfig) -> None:
    from hetero_node.protocol.reachability import lend_relay

    lend_relay(relay.relay)


RUN_FILE_OPTION = typer.Option(
    None,
    "--config",
    help="A run.toml with [run], [outer], [optim], [sparseloco], [pipeline] tables (options override it).",
)


@app.command(rich_help_panel=OPERATOR)
@expand_dataclass_options
def bootstrap(
    context: typer.Context,
    cfg: BootstrapConfig,
    relay: RelayConfig,
    run_options: RunOptions,
    outer: OuterConfig,
    optim: OptimConfig,
    sparseloco: SparseLoCoConfig,
    pipeline: PipelineConfig,
    config: Path | None = RUN_FILE_OPTION,
) -> None:
    """Run a bootstrap node: a stable entry point that announces the run (signed) to everyone who joins."""
    from hetero_node.bootstrap.join_line import join_line
    from hetero_node.bootstrap.node import BootstrapNode
    from hetero_node.client.node.run_definition import data_source_name, prepare_run, public_swarm_rule

    configs, _, chosen = _run_configs(context, run_options, outer, optim, sparseloco, pipeline, config)
    rule = public_swarm_rule(configs["outer"], "aggregation" in chosen, cfg.swarm_key is not None)
    default = " (a public swarm's default; --aggregation mean for the mean rule)" if rule != configs["outer"] else ""
    configs["outer"] = rule
    run, _store = prepare_run(*configs.values())
    _lend_relay(relay)
    node = BootstrapNode(cfg, run, data_source_name(configs["run"]))
    signal.signal(signal.SIGINT, lambda *_: node.stop.set())
    signal.signal(signal.SIGTERM, lambda *_: node.stop.set())
    console.print(f"bootstrap peer id: {node.dht.peer_id}", markup=False, highlight=False)
    console.print(
        f"run {run.run_id}: {run.preset}, {run.outer.stages} stages, H={run.outer.inner_steps}, "
        f"{run.outer.aggregation} aggregation{default}"
        f"{', loss-scored admission' if run.outer.admission == 'loss' else ''}", markup=False,
    )  # fmt: skip
    console.print("volunteers join with:", markup=False)
    console.print(f"  {join_line(node.join_addresses[0])}", markup=False, highlight=False, soft_wrap=True)
    if cfg.metrics_port is None:
        node.serve_forever()
        return
    from hetero_node.client.monitor.health import Health
    from hetero_node.client.monitor.http_server import open_dashboard
    from hetero_node.client.monitor.snapshot import read_snapshot
    from hetero_node.client.swarm.record_reader import read_peer_records
    from hetero_node.client.swarm.runtime import p2pd_alive
    from hetero_node.client.swarm.work_ledger import WorkLedger

    def readiness() -> tuple[bool, str]:
        if node.announced.is_set():
            return True, f"bootstrap: announcing run {run.run_id}"
        return False, "bootstrap: the run announcement is not stored yet"

    health = Health(partial(p2pd_alive, node.dht), readiness)
    records = partial(read_peer_records, node.dht, run.run_id, node.swarm_key, 5.0, WorkLedger())
    read = partial(read_snapshot, records, run.run_id, run.to_dict())
    with open_dashboard(cfg.metrics_host, cfg.metrics_port, read, health) as web:
        console.print(f"dashboard: {web.url}  metrics: {web.url}metrics", markup=False, highlight=False)
        node.serve_forever()


@app.command(rich_help_panel=VOLUNTEER)
@expand_dataclass_options
def join(
    context: typer.Context,
    node: NodeConfig,
    *,  # keyword-only from here: --help lists options in this order, what a volunteer needs first
    role: Role = typer.Option(
        Role.AUTO, "--role", help="auto (the planner decides), full (whole model) or stage (one pipeline stage)."
    ),
    stage: int = typer.Option(-1, "--stage", help="With --role stage: serve only this stage (-1: any)."),
    quiet: bool = typer.Option(
        False, "--quiet", help="No live status line: a log line per round instead (as when stdout is not a terminal)."
    ),
    relay: RelayConfig,
    timeouts: SyncTimeouts,
    config: Path | None = RUN_FILE_OPTION,
    run_options: RunOptions,
    outer: OuterConfig,
    optim: OptimConfig,
    sparseloco: SparseLoCoConfig,
    pipeline: PipelineConfig,
) -> None:
    """Join a swarm: learn its run from the bootstrap, measure this node, take the role that helps most, train."""
    from hetero_node.client.cli.progress import ROUND_LOG, RoundLog
    from hetero_node.client.node.join import run_node
    from hetero_node.client.node.run_definition import public_swarm_rule
    from hetero_node.client.swarm.addresses import parse_peer_multiaddrs

    if not node.peers:
        raise ConfigError("--peers is required: the multiaddr printed by `hetero-node bootstrap`")
    if stage < -1 or (stage >= 0 and role is Role.FULL):
        raise ConfigError(f"--stage {stage}: give a stage index ≥ 0 together with --role stage or auto")
    peers = parse_peer_multiaddrs([p for arg in node.peers for p in arg.replace(",", " ").split()])
    node = dataclasses.replace(node, peers=peers)  # checked before anything loads: a typo fails in a second
    if node.devices:  # as early: a mistyped device list, or no GPU for `all`, fails before the swarm is joined
        from hetero_node.client.local.devices import resolve_devices

        resolve_devices(node.device, node.devices)
    configs, explicit, chosen = _run_configs(context, run_options, outer, optim, sparseloco, pipeline, config)
    # what this node runs when its --peers announce no run (a swarm it starts itself); an announced run wins
    configs["outer"] = public_swarm_rule(configs["outer"], "aggregation" in chosen, node.swarm_key is not None)
    _lend_relay(relay)
    if quiet or not console.is_terminal:
        round_log = RoundLog()
        try:
            run_node(configs, explicit, node, timeouts, role.value, stage, on_status=ROUND_LOG.info, on_round=round_log)
        finally:
            round_log.summary()
        return
    with err_console.status("joining the swarm") as status_line:

        def show(record: RoundRecord) -> None:
            rate = record.tokens / max(record.compute_s + record.comm_s, 1e-9)
            loss = "-" if record.train_loss is None else f"{record.train_loss:.3f}"
            status_line.update(
                f"round {record.round + 1}  loss {loss}  "
                f"{rate:,.0f} tokens/s  {record.bytes_sent:,} bytes/round  group {record.group_size}"
            )

        run_node(configs, explicit, node, timeouts, role.value, stage, on_status=status_line.update, on_round=show)


@app.command("swarm-key", rich_help_panel=OPERATOR)
def swarm_key(path: Path = typer.Argument(..., help="Where to write the new key (never overwritten).")) -> None:
    """Make a key for a private swarm: give it to the bootstrap and to every peer (--swarm-key); keep it secret."""
    from hetero_node.protocol.swarm_key import create_swarm_key

    create_swarm_key(path)
    console.print(f"wrote a new swarm key to {path}", markup=False, highlight=False)


@app.command(rich_help_panel=TRY)
def export(
    checkpoint: list[Path] = typer.Option(
        ...,
        "--checkpoint",
        metavar="DIR",
        help="A full replica's --checkpoint-dir (or its replica.ckpt); repeat it for one checkpoint of every stage.",
    ),
    out: Path = typer.Option(..., "--out", help="Directory to write the Hugging Face checkpoint to."),
    tokenizer: Path | None = typer.Option(
        None, "--tokenizer", help="The run's tokenizer.json, if it trained with one (default: byte-level)."
    ),
    force: bool = typer.Option(False, "--force", help="Overwrite the exported files in a non-empty --out."),
) -> None:
    """Write a checkpoint as a Hugging Face Llama model (config.json, model.safetensors, tokenizer files)."""
    from hetero_node.client.cli.export import export_checkpoint

    done = export_checkpoint(checkpoint, out, tokenizer, force)
    console.print(
        f"exported run {done.run_id} round {done.round} ({done.preset}, {done.n_params:,} parameters) to {done.out}: "
        f"{', '.join(done.files)}; load it with transformers' LlamaForCausalLM.from_pretrained",
        markup=False, highlight=False, soft_wrap=True,
    )  # fmt: skip


@app.command(rich_help_panel=VOLUNTEER)
def status(
    peers: list[str] = typer.Option(..., "--peers", help="Multiaddr of the bootstrap (or any peer of the swarm)."),
    run_id: str | None = typer.Option(
        None, "--run-id", help="Which run to show when the bootstrap announces none (a plain hivemind-dht)."
    ),
    as_json: bool = typer.Option(False, "--json", help="Print the swarm as JSON (for scripts) and exit."),
    watch: float = typer.Option(0.0, "--watch", help="Refresh every N seconds until Ctrl-C (0: show once)."),
    serve: int | None = typer.Option(
        None, "--serve", help="Serve the web dashboard (and /metrics) on this port of 127.0.0.1 until Ctrl-C."
    ),
    swarm_key: Path | None = typer.Option(
        None, "--swarm-key", help="A private swarm's key file: its records and run are sealed with it."
    ),
) -> None:
    """Show the swarm: peers, roles, virtual replicas and their missing stages, rounds and losses."""
    from hetero_node.client.cli.status import show_status
    from hetero_node.protocol.swarm_key import load_swarm_key

    if serve is not None and not 0 <= serve < 65536:
        raise ConfigError(f"--serve must be in 0..65535, got {serve}")
    show_status(peers, run_id, as_json, watch, serve, console, load_swarm_key(swarm_key))


@app.command(rich_help_panel=VOLUNTEER)
def doctor(
    peers: list[str] = typer.Option(..., "--peers", help="The bootstrap's multiaddr, as `join` would get it."),
    host: str = typer.Option(NodeConfig.host, "--host", help="Interface to listen on, as `join --host`."),
    port: int = typer.Option(0, "--port", help="TCP port to listen on, as `join --port` (0: any free port)."),
) -> None:
    """Check that this node can join and be reached: p2pd, the join line, the bootstrap, dial-back, addresses."""
    from hetero_node.client.cli.doctor import run_doctor

    if not 0 <= port < 65536:
        raise ConfigError(f"--port must be in 0..65535, got {port}")
    if not run_doctor(peers, host, port, console):
        raise typer.Exit(1)


@app.command(rich_help_panel=TRY)
@expand_dataclass_options
def demo(cfg: DemoConfig) -> None:
    """Run a local swarm on this machine: a bootstrap and N full replicas, live table, summary, optional report."""
    from hetero_node.client.cli.demo import run_demo
    from hetero_node.client.cli.progress import print_table

    report = run_demo(cfg, console)
    summary = report["summary"]
    rows = [(key.replace("_", " "), format_value(value)) for key, value in summary.items()]
    print_table(console, "demo summary", ("", ""), rows)
    if summary["failed_peers"]:
        raise HeteroNodeError(f"peers failed: {summary['failed_peers']}; see their logs in the work directory")


@app.command(rich_help_panel=OPERATOR)
@expand_dataclass_options
def plan(
    context: typer.Context,
    cfg: PlanConfig,
    run_options: RunOptions,
    outer: OuterConfig,
    optim: OptimConfig,
    sparseloco: SparseLoCoConfig,
    pipeline: PipelineConfig,
    config: Path | None = RUN_FILE_OPTION,
) -> None:
    """Plan a described (--swarm) or live (--peers) swarm with the cost model: roles, virtual replicas, rank and H,
    with predicted round time, tokens/s, utilisation and bytes per peer, next to the live planner or the swarm now."""
    from hetero_node.client.cli.plan import print_plan, run_plan, sizing_run

    configs, _, _ = _run_configs(context, run_options, outer, optim, sparseloco, pipeline, config)
    result, peers, baseline = run_plan(cfg, sizing_run(*configs.values()))
    print_plan(result, peers, cfg, console, baseline)
