"""`hetero-node export`: a full model from replica checkpoints, written as a Hugging Face Llama checkpoint.

The checkpoint's `run_config` says which model it holds (preset, vocabulary, tokenizer, subspace); its weights come
from one full replica's checkpoint, or from stage peers' checkpoints of one round that together hold every layer
(parameter names are global, so they merge by name). The output appears whole or not at all: everything is written
to a temporary directory beside `--out`, then renamed into place.
"""

from __future__ import annotations

import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from hetero_node.client.roles.checkpoint import CHECKPOINT_NAME, read_checkpoint
from hetero_node.models.config import ModelConfig, get_preset
from hetero_node.models.hf_export import FIXED_TABLE, expected_shapes, write_llama_weights
from hetero_node.models.hf_tokenizer import tokenizer_files
from hetero_node.protocol.errors import CheckpointError, ConfigError, HeteroNodeError
from hetero_node.protocol.run_config import RunConfig

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Exported:
    """What `export_checkpoint` wrote."""

    out: Path
    run_id: str
    round: int
    preset: str
    n_params: int
    files: list[str]


def checkpoint_file(path: Path) -> Path:
    """A node's --checkpoint-dir (holding replica.ckpt) or the checkpoint file itself."""
    return path / CHECKPOINT_NAME if path.is_dir() else path


def read_run_config(state: dict[str, Any], path: Path) -> RunConfig:
    """The run config a checkpoint was written under; checkpoints written before export existed have none."""
    if "run_config" not in state:
        raise CheckpointError(
            f"checkpoint {path} has no run config (written by an older hetero-node), so its model's shape is "
            "unknown; resume the node with this version for one round to get an exportable checkpoint"
        )
    try:
        return RunConfig.from_dict(state["run_config"])
    except (ConfigError, AttributeError) as e:
        raise CheckpointError(f"checkpoint {path} has an unreadable run config: {e}") from None


def merge_models(paths: list[Path]) -> tuple[RunConfig, int, dict[str, Tensor]]:
    """(run config, round, model state) of one or more checkpoints of the same run and round."""
    merged: dict[str, Tensor] = {}
    first: tuple[Path, dict[str, Any]] | None = None
    for path in map(checkpoint_file, paths):
        if not path.exists():
            raise CheckpointError(f"no checkpoint at {path} (a node writes {CHECKPOINT_NAME} under --checkpoint-dir)")
        state = read_checkpoint(path)
        if first is None:
            first = (path, state)
        elif (state["run_id"], state["round"]) != (first[1]["run_id"], first[1]["round"]):
            raise CheckpointError(
                f"checkpoints {first[0]} (run {first[1]['run_id']}, round {first[1]['round']}) and {path} "
                f"(run {state['run_id']}, round {state['round']}) are not of the same run and round"
            )
        weights = state.get("model")
        if not isinstance(weights, dict):
            raise CheckpointError(f"checkpoint {path} holds no model weights")
        for name, tensor in weights.items():
            if name in merged and not torch.equal(merged[name], tensor):
                raise CheckpointError(f"checkpoints {first[0]} and {path} disagree on {name}")
            merged[name] = tensor
    if first is None:
        raise ConfigError("pass at least one --checkpoint")
    return read_run_config(first[1], first[0]), int(first[1]["round"]), merged


def check_complete(cfg: ModelConfig, run: RunConfig, model: dict[str, Tensor], paths: list[Path]) -> None:
    """Refuse a part of the model (a stage peer's checkpoint) and a subspace model without its fixed table."""
    shapes = expected_shapes(cfg)
    missing = [name for name in shapes if name not in model and name != FIXED_TABLE]
    if missing:
        layers = sorted({int(name.split(".")[1]) for name in missing if name.startswith("layers.")})
        parts = ["embedding"] if "embed.weight" in missing else []
        parts += [f"layers {_spans(layers)}"] if layers else []
        parts += ["head"] if "head.weight" in missing else []
        raise ConfigError(
            f"{', '.join(map(str, paths))} hold only part of the model (missing: {'; '.join(parts)}): a pipeline "
            "stage's checkpoint; export needs a full replica's checkpoint, or one of every stage (repeat --checkpoint)"
        )
    if run.uses_subspace and FIXED_TABLE not in model:
        raise CheckpointError(f"the run uses the subspace embedding, but {paths[0]} holds no {FIXED_TABLE} table")


def _spans(indices: list[int]) -> str:
    """[0, 1, 2, 5] → "0-2, 5"."""
    spans: list[list[int]] = []
    for i in indices:
        if spans and spans[-1][1] == i - 1:
            spans[-1][1] = i
        else:
            spans.append([i, i])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)


def check_out(out: Path, force: bool) -> None:
    """--out may be new or an empty directory; a non-empty one only with --force (then our files are replaced)."""
    if not out.parent.is_dir():
        raise ConfigError(f"--out {out}: directory {out.parent} does not exist")
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out} is a file, not a directory")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise ConfigError(f"--out {out} is not empty; pass --force to overwrite the exported files in it")


def publish(tmp: Path, out: Path) -> None:
    """Move the finished files into `out`: a rename of the whole directory when `out` does not exist yet."""
    if not out.exists():
        os.rename(tmp, out)
        return
    for item in tmp.iterdir():
        os.replace(item, out / item.name)
    tmp.rmdir()


def export_checkpoint(checkpoints: list[Path], out: Path, tokenizer: Path | None, force: bool) -> Exported:
    """Write `out`/config.json, model.safetensors, tokenizer.json and tokenizer_config.json (see module docstring)."""
    check_out(out, force)
    run, round_, model = merge_models(checkpoints)
    try:
        cfg = get_preset(run.preset, vocab_size=run.vocab_size)  # as a full replica builds it
    except HeteroNodeError as e:
        raise CheckpointError(f"the checkpoint's run config does not give a model: {e}") from None
    check_complete(cfg, run, model, checkpoints)
    tok = tokenizer_files(run.tokenizer_identity, tokenizer, cfg.max_seq_len)
    tmp = out.parent / f".{out.name}.export-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)  # our own leftover from a killed export of the same pid
    tmp.mkdir()
    try:
        n_params = write_llama_weights(tmp, cfg, model, tok.eos_id)
        for name, text in tok.files.items():
            (tmp / name).write_text(text, encoding="utf-8")
        files = sorted(item.name for item in tmp.iterdir())
        publish(tmp, out)
    except OSError as e:
        raise CheckpointError(f"could not write the export to {out}: {e}") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    logger.info("exported run %s round %d to %s", run.run_id, round_, out)
    return Exported(out, run.run_id, round_, run.preset, n_params, files)
