"""`hetero-node-lab byzantine`: finite, well-formed attacks on the outer step, and what each aggregation rule
lets them do.

One process, no network: the lab measures the *rule*, not the transport (signed records, strict decoders, size
caps and group admission are tested against real processes elsewhere). Everything else is the nodes' own code: R
replicas train H inner steps each from the same θ(t) on their own data shard (`InnerTrainer`, `ShardBatches`),
encode Δ with the run's `OuterMethod` per parameter shard (error feedback, top-k, 2-bit codec) and decode the
bytes, and every member's θ(t+1) is `combine` + `update` of those messages, as in a group. Attackers are members
whose message is crafted (see `BYZANTINE_ATTACKS` in `bench.config`); it always passes `validate_message`.

A rule may carry `+loss`: Gauntlet-style admission (templar's LossScore) before it combines, by the nodes' rule
under `--admission loss` (`judge_members`; one judge here: the nodes agree their judges' verdicts).

A cell is (rule, honest group size, attack); its figure is the honest replicas' eval loss after the last round,
compared with the same rule's run without the attacker (the loss impact) and with the mean rule's clean run (the
price of the rule itself). Runs start from one warm-started model, so early-training noise does not drown the
attacks.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import math
import statistics
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch
from rich.progress import Progress

from hetero_node.bench.config import ByzantineConfig
from hetero_node.bench.results import write_report
from hetero_node.models.config import get_preset
from hetero_node.models.data import ShardBatches, TokenStore, build_token_store, probe_batches, val_batches
from hetero_node.models.paths import default_cache_dir
from hetero_node.models.shards import shard_parameter_names, shard_tensors
from hetero_node.models.tokenizer import load_tokenizer
from hetero_node.models.trainer import InnerTrainer
from hetero_node.models.transformer import Transformer
from hetero_node.protocol.admission import PROBE_BATCHES, loss_admitted
from hetero_node.protocol.aggregation import aggregate, contribution_norm, peak_value
from hetero_node.protocol.outer_methods import OuterMethod, outer_method
from hetero_node.protocol.run_config import OuterConfig, RunConfig
from hetero_node.protocol.sparseloco import CompressedTensor, ErrorFeedbackCompressor, SparseMessage

logger = logging.getLogger(__name__)

SCALE = 100.0
"""`scale`: how much the attacker multiplies its honest pseudo-gradient by."""
DILUTE = 1e-3
"""`dilute`: how much the attacker shrinks its honest pseudo-gradient by (it agrees, and adds nothing)."""
NOISE = 3.0
"""`noise`: the norm of the random step the attacker adds to its honest one, in units of that one's norm."""
CLAIMED_TOKENS = 2**40
"""`heavy-flip`: how many times an honest replica's tokens the attacker claims to have trained (the review's claim;
the lab has no records, so the nodes' bound by advertised speed, `protocol/claims.py`, does not apply here)."""
LOSS_ADMISSION = "+loss"
DEVICE = torch.device("cpu")


@dataclass(frozen=True)
class WarmStart:
    """The common start of every replica of a seed's runs, and how the model splits into parameter shards."""

    trainer: InnerTrainer
    shard_names: list[list[str]]


class Member:
    """One replica of the lab: its model, inner optimizer, data shard and one outer method per parameter shard."""

    def __init__(self, run: RunConfig, store: TokenStore, warm: WarmStart, data_shard: int) -> None:
        self.model = copy.deepcopy(warm.trainer.model)
        self.trainer = InnerTrainer(self.model, run.optim, warm.trainer.total_steps, DEVICE)
        self.trainer.step = warm.trainer.step  # the LR schedule goes on where the warm start stopped
        self.batches = ShardBatches(store, data_shard, run.data_shards, run.batch_size, run.seq_len, run.seed)
        self.shard_names = warm.shard_names
        self.shards = [shard_tensors(self.model, names) for names in self.shard_names]
        self.methods = [outer_method(run, [tuple(p.shape) for p in params]) for params in self.shards]
        self.fixed: list[SparseMessage] = []
        """fixed-top/collude: the message whose coordinates the attacker pushes every round (its first)."""

    def train(self, steps: int, round_: int) -> None:
        for i in range(steps):
            self.trainer.train_step(*self.batches.batch(round_ * steps + i))

    def deltas(self, start: list[list[torch.Tensor]], shard: int) -> list[torch.Tensor]:
        """Δ = θ(t) − θ_local of one parameter shard."""
        return [s - p.detach() for s, p in zip(start[shard], self.shards[shard], strict=True)]

    def messages(self, start: list[list[torch.Tensor]], sign: float = 1.0) -> list[SparseMessage]:
        """This round's message per shard, through the real codec: sign·Δ encoded to bytes and decoded."""
        out = []
        for shard, method in enumerate(self.methods):
            deltas = [sign * d for d in self.deltas(start, shard)]
            out.append(method.decode(method.encode(deltas).payload))
        return out

    @torch.no_grad()
    def set_params(self, new: list[list[torch.Tensor]]) -> None:
        for params, tensors in zip(self.shards, new, strict=True):
            for p, value in zip(params, tensors, strict=True):
                p.copy_(value)


def one_shot(method: OuterMethod, steps: list[torch.Tensor]) -> SparseMessage:
    """`steps` through a compressor of the attacker's own, without error feedback: a well-formed message of them."""
    config = dataclasses.replace(method.config, ef_decay=0.0)
    return ErrorFeedbackCompressor(method.shapes, config).compress(steps)


def _with_values(part: CompressedTensor, codes: torch.Tensor, lookup: tuple[float, float, float, float]) -> Any:
    """`part` with new codes and table (mean 0): a well-formed message that says what the attacker wants."""
    return dataclasses.replace(part, codes=codes.to(torch.uint8), mean=0.0, lookup=lookup)


def zero_message(msg: SparseMessage) -> SparseMessage:
    return dataclasses.replace(
        msg, tensors=tuple(_with_values(p, torch.zeros_like(p.codes), (0.0, 0.0, 0.0, 0.0)) for p in msg.tensors)
    )


def fixed_top_message(template: SparseMessage, honest: SparseMessage) -> SparseMessage:
    """The template's coordinates, every one at this round's honest top centroid (largest |value|), positive."""
    parts = []
    for fixed, own in zip(template.tensors, honest.tensors, strict=True):
        parts.append(_with_values(fixed, torch.full_like(fixed.codes, 3), (0.0, 0.0, 0.0, peak_value(own))))
    return dataclasses.replace(template, tensors=tuple(parts))


def head_row_deltas(attacker: Member, budget: float, token: int = 0) -> list[list[torch.Tensor]]:
    """Δ per shard that raises one token's logit at every position: row `token` of the head moved along the mean
    final hidden state, with the whole norm `budget` (the honest message's norm), nothing anywhere else."""
    seen: list[torch.Tensor] = []
    hook = attacker.model.head.register_forward_hook(lambda _m, inputs, _out: seen.append(inputs[0].detach()))
    with torch.no_grad():
        attacker.model(attacker.batches.batch(0)[0])
    hook.remove()
    direction = seen[0].reshape(-1, seen[0].shape[-1]).mean(0)
    deltas = []
    for names, params in zip(attacker.shard_names, attacker.shards, strict=True):
        shard = [torch.zeros_like(p) for p in params]
        if "head.weight" in names:  # θ(t+1) = θ(t) − α·agg: a negative Δ along h̄ raises w_token·h
            shard[names.index("head.weight")][token] = -budget * direction / direction.norm()
        deltas.append(shard)
    return deltas


def concentrated_messages(
    attacker: Member, honest: list[SparseMessage], start: list[list[torch.Tensor]] | None = None
) -> list[SparseMessage]:
    """`head_row_deltas` through a compressor of its own (no error feedback), in the honest shape of the message.
    With `start`, every other tensor carries the attacker's honest Δ, so its step agrees with the others' overall
    (agreement admission counts it) while the head row takes its budget there."""
    budget = math.sqrt(math.fsum(contribution_norm(m) ** 2 for m in honest))
    out = []
    for s, (method, deltas) in enumerate(zip(attacker.methods, head_row_deltas(attacker, budget), strict=True)):
        if start is not None:
            names = attacker.shard_names[s]
            deltas = [d if name == "head.weight" else o for name, d, o in zip(names, deltas, attacker.deltas(start, s),
                                                                                 strict=True)]  # fmt: skip
        out.append(one_shot(method, deltas))
    return out


def negated_messages(attacker: Member, honest: list[list[SparseMessage]]) -> list[SparseMessage]:
    """−SCALE × the honest members' mean step per shard, through a compressor of its own (no error feedback): the
    rule's clip brings it down to its full allowance. It needs every honest message before it sends its own."""
    out = []
    for s, method in enumerate(attacker.methods):
        mean = aggregate([sent[s] for sent in honest], method.shapes).tensors
        out.append(one_shot(method, [-SCALE * t for t in mean]))
    return out


def noisy_messages(attacker: Member, start: list[list[torch.Tensor]]) -> list[SparseMessage]:
    """Its Δ plus a random step `NOISE` times as long, through a compressor of its own: it still points the honest
    way a little (cosine ~1/3 with its own Δ), so agreement admission counts it, and the rule clips it to the
    median norm, most of which is noise."""
    gen = torch.Generator().manual_seed(attacker.trainer.step)  # a new direction every round
    out = []
    for shard, method in enumerate(attacker.methods):
        deltas = attacker.deltas(start, shard)
        noise = [torch.randn(d.shape, generator=gen) for d in deltas]
        scale = NOISE * _norm(deltas) / _norm(noise)
        out.append(one_shot(method, [d + scale * n for d, n in zip(deltas, noise, strict=True)]))
    return out


def _norm(tensors: list[torch.Tensor]) -> float:
    return math.sqrt(math.fsum(float(t.double().square().sum()) for t in tensors))


def attacker_messages(
    attack: str, attacker: Member, start: list[list[torch.Tensor]], honest_sent: list[list[SparseMessage]]
) -> list[SparseMessage]:
    """What one attacker sends this round (it has trained its H steps like everyone else); `honest_sent`: the
    honest members' messages, which only `negate` reads."""
    if attack == "scale":
        return attacker.messages(start, sign=SCALE)
    if attack == "blind-negate":
        return attacker.messages(start, sign=-SCALE)
    if attack == "dilute":
        return attacker.messages(start, sign=DILUTE)
    if attack == "noise":
        return noisy_messages(attacker, start)
    if attack == "negate":
        return negated_messages(attacker, honest_sent)
    if attack in ("sign-flip", "heavy-flip"):
        return attacker.messages(start, sign=-1.0)
    honest = attacker.messages(start)
    if attack == "zero":
        return [zero_message(m) for m in honest]
    if attack == "concentrate":
        return concentrated_messages(attacker, honest)
    if attack == "hidden-concentrate":
        return concentrated_messages(attacker, honest, start)
    attacker.fixed = attacker.fixed or honest
    return [fixed_top_message(t, m) for t, m in zip(attacker.fixed, honest, strict=True)]


def warm_start(run: RunConfig, store: TokenStore, steps: int, total_steps: int) -> WarmStart:
    """One model trained `steps` steps on its own data order, with an LR schedule of `total_steps`."""
    preset = get_preset(run.preset, vocab_size=run.vocab_size)
    trainer = InnerTrainer(Transformer(preset, seed=run.seed), run.optim, total_steps, DEVICE)
    batches = ShardBatches(store, 0, 1, run.batch_size, run.seq_len, run.seed + 1000)
    for i in range(steps):
        trainer.train_step(*batches.batch(i))
    return WarmStart(trainer, shard_parameter_names(preset, run.outer.stages))


def judge_members(
    judge: Member, start: list[list[torch.Tensor]], sent: list[list[SparseMessage]], weights: list[float],
    names: list[str], probe: list[Any],
) -> list[int]:  # fmt: skip
    """Which members a Gauntlet-style judge admits (`protocol/admission.py: loss_admitted`, the nodes' rule under
    `--admission loss`): the loss of `probe` (batches from the data shard nobody trains on) before and after the
    outer step each member's messages make alone, under the judge's rule. Leaves the judge's weights at θ(t). One
    judge: the nodes agree their judges' verdicts, which the lab's single process does not need."""
    judge.set_params(start)  # it holds its own trained weights until the round's end
    before = judge.trainer.evaluate(probe)
    drops = {}
    for i, msgs in enumerate(sent):
        judge.set_params([m.update(start[s], m.combine([msgs[s]], [weights[i]], [names[i]]))
                          for s, m in enumerate(judge.methods)])  # fmt: skip
        drops[names[i]] = before - judge.trainer.evaluate(probe)
    judge.set_params(start)
    admissible = loss_admitted(drops)
    return [i for i, name in enumerate(names) if name in admissible]


def run_cell(
    run: RunConfig, store: TokenStore, warm: WarmStart, held_out: list, honest: int, attack: str | None,
    on_round: Callable[[], None], admission: bool = False,
) -> list[float]:  # fmt: skip
    """Eval loss of the honest replicas after each round of one (rule, group, attack) run; `admission`: the rule's
    `+loss` (`judge_members`)."""
    n_attackers = 0 if attack is None else 2 if attack == "collude" else 1
    members = [Member(run, store, warm, r) for r in range(honest + n_attackers)]
    names = [f"honest-{r}" for r in range(honest)] + [f"attacker-{a}" for a in range(n_attackers)]
    tokens = float(run.outer.inner_steps * run.batch_size * run.seq_len)
    weights = [tokens] * honest + [tokens * (CLAIMED_TOKENS if attack == "heavy-flip" else 1)] * n_attackers
    losses = []
    for t in range(run.outer.rounds):
        start = [[p.detach().clone() for p in params] for params in members[0].shards]
        for m in members:
            m.train(run.outer.inner_steps, t)
        sent = [m.messages(start) for m in members[:honest]]
        for a in members[honest:]:
            sent.append(attacker_messages(attack or "", a, start, sent[:honest]))
        if attack == "collude":  # both push the first attacker's coordinates
            sent[-1] = sent[-2]
        counted = range(len(sent))
        if admission:
            probe = probe_batches(store, run.data_shards, run.batch_size, run.seq_len, run.seed, t, PROBE_BATCHES)
            counted = judge_members(members[0], start, sent, weights, names, probe)
        judge: list[OuterMethod] = members[0].methods
        new = []
        for s, method in enumerate(judge):
            combined = method.combine([sent[i][s] for i in counted], [weights[i] for i in counted],
                                      [names[i] for i in counted])  # fmt: skip
            new.append(method.update(start[s], combined))
        for m in members:
            m.set_params(new)
        losses.append(members[0].trainer.evaluate(held_out))
        on_round()
    return losses


@dataclass
class Cell:
    rule: str
    honest: int
    attack: str
    finals: list[float]
    """Eval loss after the last round, per seed."""
    curves: list[list[float]]


def run_byzantine(cfg: ByzantineConfig, progress: Progress) -> dict[str, Any]:
    """Every (rule, group, attack) cell for every seed, plus each rule's clean run; writes report.json/.md."""
    tokenizer = load_tokenizer(None)
    store = build_token_store(None, tokenizer, default_cache_dir())
    groups = [(n, a) for n in cfg.honest_sizes for a in ["none", *cfg.attack_list] if a != "collude"]
    groups += [(max(cfg.honest_sizes), "collude")] if "collude" in cfg.attack_list else []
    cells = {(rule, n, a): Cell(rule, n, a, [], []) for rule in cfg.rule_list for n, a in groups}
    task = progress.add_task("byzantine cells", total=len(cells) * cfg.seeds * cfg.rounds)
    for seed in range(cfg.seeds):
        total = cfg.warm_steps + cfg.rounds * cfg.inner_steps
        warm = warm_start(_run_config(cfg, tokenizer.vocab_size, store, seed, "mean"), store, cfg.warm_steps, total)
        held_out = val_batches(store, cfg.batch_size, cfg.seq_len, cfg.eval_batches)
        start_loss = warm.trainer.evaluate(held_out)
        for rule in cfg.rule_list:
            run = _run_config(cfg, tokenizer.vocab_size, store, seed, rule.removesuffix(LOSS_ADMISSION))
            for (r, n, attack), cell in cells.items():
                if r != rule:
                    continue
                progress.update(task, description=f"seed {seed} {rule} {n}+{attack}")
                curve = run_cell(run, store, warm, held_out, n, None if attack == "none" else attack,
                                 lambda: progress.advance(task), admission=rule.endswith(LOSS_ADMISSION))  # fmt: skip
                cell.finals.append(curve[-1])
                cell.curves.append([start_loss, *curve])
                logger.info("seed %d %s %d+%s: %s", seed, rule, n, attack, " ".join(f"{x:.3f}" for x in curve))
    report = {"config": {k: str(v) for k, v in asdict(cfg).items()}, "cells": [asdict(c) for c in cells.values()]}
    write_report(cfg.out, report, render_markdown(report))
    return report


def _run_config(cfg: ByzantineConfig, vocab_size: int, store: TokenStore, seed: int, rule: str) -> RunConfig:
    return RunConfig(
        preset=cfg.preset, vocab_size=vocab_size, batch_size=cfg.batch_size, seq_len=cfg.seq_len, seed=seed,
        data_shards=max(cfg.honest_sizes) + 2, data_identity=store.identity, tokenizer_identity="lab",
        outer=OuterConfig(inner_steps=cfg.inner_steps, rounds=cfg.rounds, aggregation=rule),
    )  # fmt: skip


def _summary(values: list[float]) -> str:
    mean = statistics.fmean(values)
    return f"{mean:.3f}" if len(values) < 2 else f"{mean:.3f} ± {statistics.stdev(values):.3f}"


def progress_kept(cell: dict[str, Any], clean: dict[str, Any]) -> float:
    """The share of the clean run's loss decrease from the warm start that the attacked run still made (the trust
    issue's target: at least 90% with one attacker in three, 95% with one in five)."""
    drop = statistics.fmean(curve[0] - curve[-1] for curve in cell["curves"])
    return drop / statistics.fmean(curve[0] - curve[-1] for curve in clean["curves"])


def worst_round(cell: dict[str, Any], clean: dict[str, Any]) -> float:
    """The largest amount by which the attacked run's eval loss exceeded the clean run's after any round, over
    seeds, as a share of the clean loss (the trust issue's target: no single member moves eval loss by more than 1%
    in a round, whatever it claims). Never below 0: an attack that helps moves nothing the wrong way."""
    gaps = (
        attacked / plain - 1
        for curve, clean_curve in zip(cell["curves"], clean["curves"], strict=True)
        for attacked, plain in zip(curve[1:], clean_curve[1:], strict=True)
    )
    return max(0.0, *gaps)


def render_markdown(report: dict[str, Any]) -> str:
    """One row per (group, attack): each rule's final eval loss, its change against that rule's clean run, the
    progress kept and the worst round."""
    cells = {(c["rule"], c["honest"], c["attack"]): c for c in report["cells"]}
    rules = list(dict.fromkeys(c["rule"] for c in report["cells"]))
    rows = list(dict.fromkeys((c["honest"], c["attack"]) for c in report["cells"]))
    columns = ("eval loss", "vs clean", "progress kept", "worst round")
    header = "| group | attack | " + " | ".join(f"{r}: {c}" if c == columns[0] else c for r in rules for c in columns)
    lines = [header + " |", "|" + "---|" * (2 + len(columns) * len(rules))]
    for honest, attack in rows:
        attackers = 0 if attack == "none" else 2 if attack == "collude" else 1
        row = [f"{honest} honest + {attackers}", attack]
        for rule in rules:
            cell, clean = cells.get((rule, honest, attack)), cells.get((rule, honest, "none"))
            if cell is None or clean is None:
                row += ["–"] * len(columns)
                continue
            change = statistics.fmean(cell["finals"]) / statistics.fmean(clean["finals"]) - 1
            kept, worst = progress_kept(cell, clean), worst_round(cell, clean)
            row += [_summary(cell["finals"]), f"{change:+.1%}", f"{kept:.0%}", f"+{worst:.1%}"]
        lines.append("| " + " | ".join(row) + " |")
    config = report["config"]
    lines.append(
        f"\n`{config['preset']}`, warm start {config['warm_steps']} steps, {config['rounds']} rounds of H = "
        f"{config['inner_steps']}, {config['seeds']} seed(s); eval loss of the honest replicas after the last round; "
        "progress kept: its drop from the warm start's eval loss over the clean run's; worst round: the most the "
        "attacked run's eval loss exceeded the clean run's after any round (goal: at most 1%)."
    )
    return "\n".join(lines) + "\n"
