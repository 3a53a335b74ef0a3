"""`hetero-node export`: a replica checkpoint loads in transformers' LlamaForCausalLM and gives our logits; the
subspace embedding (T_fixed + E_S) folds into one matrix; the tokenizer files give our ids; bad inputs are refused.

Checkpoints are written by `Replica.checkpoint` itself (on a stand-in replica), so the test reads what a node writes.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import tokenizers
import torch
from factories import run_config
from tokenizers import models, pre_tokenizers, trainers

from hetero_node.client.cli.app import main
from hetero_node.client.cli.export import export_checkpoint
from hetero_node.client.roles.checkpoint import CHECKPOINT_NAME, save_checkpoint
from hetero_node.client.roles.replica import Replica
from hetero_node.models.config import get_preset
from hetero_node.models.stages import split_model
from hetero_node.models.subspace import enable_subspace, subspace_basis
from hetero_node.models.tokenizer import ByteTokenizer, HFTokenizer
from hetero_node.models.transformer import Transformer
from hetero_node.protocol.errors import CheckpointError, ConfigError
from hetero_node.protocol.run_config import PipelineConfig, RunConfig

transformers = pytest.importorskip("transformers", reason="the export is checked against transformers (dev extra)")

LOGIT_ATOL = 1e-4
"""fp32 tolerance on logits of magnitude ~1 (measured: ~1e-6; a wrong name, norm or RoPE layout is off by ~1)."""
TEXTS = ["Hello, world!", "  two  spaces\n\nand a tab\t.", "héllo ünïcødé — 日本語 🙂", " leading space", ""]


@pytest.fixture(autouse=True)
def offline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")


def byte_run(stages: int, **changes: object) -> RunConfig:
    """A tiny run on the byte-level tokenizer (the factory's identity is a placeholder)."""
    return run_config(stages=stages, **{"tokenizer_identity": ByteTokenizer.identity, **changes})


def trained_model(run: RunConfig) -> Transformer:
    """The run's model as a full replica builds it, then moved off its initialisation as training would: norms
    leave 1 and, in a subspace run, E_S leaves span(U) so T_fixed + E_S really needs folding."""
    cfg = get_preset(run.preset, vocab_size=run.vocab_size)
    model = Transformer(cfg, seed=run.seed)
    if run.uses_subspace:
        enable_subspace(model, subspace_basis(cfg.d_model, run.pipeline.rank(cfg.d_model), run.seed))
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
    return model.eval()


def write_checkpoint(
    directory: Path, run: RunConfig, module: torch.nn.Module, slot: list[int], round_: int = 3
) -> Path:
    replica = SimpleNamespace(
        node=SimpleNamespace(checkpoint_dir=directory), run_cfg=run, round=round_, certified=round_, slot=lambda: slot,
        module=module, trainer=SimpleNamespace(state_dict=dict), syncs={}, checkpoint_extras=dict, checkpoints=None,
    )  # fmt: skip
    Replica.checkpoint(replica)  # type: ignore[arg-type]
    replica.checkpoints.close()  # written in the background: on disk once the writer is closed, as when a node exits
    return directory


def max_logit_diff(model: Transformer, out: Path) -> float:
    """Max |logits(ours) − logits(LlamaForCausalLM)| on a batch covering every RoPE position."""
    hf = transformers.LlamaForCausalLM.from_pretrained(out).eval()
    tokens = torch.randint(
        0, model.cfg.vocab_size, (3, model.cfg.max_seq_len), generator=torch.Generator().manual_seed(2)
    )
    with torch.no_grad():
        ours, theirs = model(tokens), hf(input_ids=tokens).logits
    assert theirs.dtype == torch.float32 and theirs.shape == ours.shape
    assert ours.abs().max() > 0.5  # the comparison below is not between two near-zero tensors
    return float((ours - theirs).abs().max())


@pytest.mark.parametrize("subspace", [True, False], ids=["subspace-fold", "dense"])
def test_a_full_replica_checkpoint_loads_in_transformers_with_our_logits(tmp_path: Path, subspace: bool) -> None:
    run = byte_run(2, pipeline=PipelineConfig(activation_compression="subspace" if subspace else "none"))
    model = trained_model(run)
    assert (model.embed_fixed is not None) == subspace
    if subspace:
        assert model.embed_fixed.abs().max() > 0.01  # T_fixed matters: dropping it would change the logits
    done = export_checkpoint([write_checkpoint(tmp_path / "ckpt", run, model, [0, 1])], tmp_path / "hf", None, False)
    assert done.files == ["config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]
    assert (done.run_id, done.round, done.n_params) == (run.run_id, 3, model.cfg.n_params())
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["eos_token_id"] is None
    diff = max_logit_diff(model, tmp_path / "hf")
    print(f"max abs logit difference ({'subspace' if subspace else 'dense'}): {diff:.2e}")
    assert diff < LOGIT_ATOL


def test_stage_checkpoints_are_refused_alone_and_exported_together(tmp_path: Path) -> None:
    run = byte_run(2)
    model = trained_model(run)
    stage_dirs = [
        write_checkpoint(tmp_path / f"s{i}", run, stage, [0, i]) for i, stage in enumerate(split_model(model, 2))
    ]
    with pytest.raises(ConfigError, match=r"only part of the model \(missing: layers 2-3; head\).*full replica"):
        export_checkpoint(stage_dirs[:1], tmp_path / "hf", None, False)
    with pytest.raises(ConfigError, match=r"missing: embedding; layers 0-1\)"):
        export_checkpoint(stage_dirs[1:], tmp_path / "hf", None, False)
    late = write_checkpoint(tmp_path / "late", run, split_model(model, 2)[1], [0, 1], round_=4)
    with pytest.raises(CheckpointError, match="not of the same run and round"):
        export_checkpoint([stage_dirs[0], late], tmp_path / "hf", None, False)
    assert not (tmp_path / "hf").exists()
    export_checkpoint(stage_dirs, tmp_path / "hf", None, False)
    assert max_logit_diff(model, tmp_path / "hf") < LOGIT_ATOL


def test_the_byte_level_tokenizer_exports_as_a_tokenizer_json_with_our_ids(tmp_path: Path) -> None:
    run = byte_run(1)
    export_checkpoint([write_checkpoint(tmp_path / "ckpt", run, trained_model(run), [0])], tmp_path / "hf", None, False)
    raw = tokenizers.Tokenizer.from_file(str(tmp_path / "hf" / "tokenizer.json"))
    auto = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    ours = ByteTokenizer()
    for text in [*TEXTS, bytes(range(1, 128)).decode()]:
        assert raw.encode(text, add_special_tokens=False).ids == ours.encode(text)
        assert auto(text)["input_ids"] == ours.encode(text)
        assert auto.decode(ours.encode(text)) == text


def hf_tokenizer_file(path: Path) -> Path:
    """A small trained BPE tokenizer.json with an end-of-text token."""
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(TEXTS * 5, trainers.BpeTrainer(vocab_size=120, special_tokens=["</s>"]))
    tok.save(str(path))
    return path


def test_a_run_with_a_tokenizer_json_exports_that_file_checked_against_the_run(tmp_path: Path) -> None:
    tokenizer = HFTokenizer(hf_tokenizer_file(tmp_path / "tokenizer.json"))
    run = run_config(stages=1, vocab_size=tokenizer.vocab_size, tokenizer_identity=tokenizer.identity)
    model = trained_model(run)
    ckpt = write_checkpoint(tmp_path / "ckpt", run, model, [0])
    with pytest.raises(ConfigError, match="pass it with --tokenizer"):
        export_checkpoint([ckpt], tmp_path / "hf", None, False)
    other = HFTokenizer(hf_tokenizer_file(tmp_path / "other.json")).path
    other.write_text(other.read_text().replace("</s>", "<eos>"))
    with pytest.raises(ConfigError, match="is not the run's tokenizer"):
        export_checkpoint([ckpt], tmp_path / "hf", other, False)
    export_checkpoint([ckpt], tmp_path / "hf", tokenizer.path, False)
    assert (tmp_path / "hf" / "tokenizer.json").read_bytes() == tokenizer.path.read_bytes()
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["eos_token_id"] == tokenizer.eos_id is not None
    auto = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert auto.eos_token_id == tokenizer.eos_id
    assert all(auto(text, add_special_tokens=False)["input_ids"] == tokenizer.encode(text) for text in TEXTS)
    assert max_logit_diff(model, tmp_path / "hf") < LOGIT_ATOL


def test_bad_checkpoints_and_a_non_empty_out_are_refused(tmp_path: Path) -> None:
    run = byte_run(1)
    ckpt = write_checkpoint(tmp_path / "ckpt", run, trained_model(run), [0])
    with pytest.raises(CheckpointError, match="no checkpoint at"):
        export_checkpoint([tmp_path / "nowhere"], tmp_path / "hf", None, False)
    old = tmp_path / "old"
    save_checkpoint(old, {"run_id": run.run_id, "round": 1, "model": Transformer(get_preset("tiny")).state_dict()})
    with pytest.raises(CheckpointError, match="has no run config"):
        export_checkpoint([old], tmp_path / "hf", None, False)
    broken = run.to_dict() | {"preset": "huge"}
    save_checkpoint(old, {"run_id": run.run_id, "round": 1, "model": {}, "run_config": broken})
    with pytest.raises(CheckpointError, match="unknown model preset 'huge'"):
        export_checkpoint([old], tmp_path / "hf", None, False)
    data = bytearray((ckpt / CHECKPOINT_NAME).read_bytes())
    data[len(data) // 2] ^= 0xFF
    corrupt = tmp_path / "corrupt.ckpt"
    corrupt.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="corrupt"):
        export_checkpoint([corrupt], tmp_path / "hf", None, False)

    out = tmp_path / "hf"
    out.mkdir()
    (out / "README.md").write_text("mine")
    with pytest.raises(ConfigError, match="not empty; pass --force"):
        export_checkpoint([ckpt], out, None, False)
    assert sorted(p.name for p in out.iterdir()) == ["README.md"]
    export_checkpoint([ckpt], out, None, True)
    assert (out / "README.md").read_text() == "mine" and (out / "model.safetensors").is_file()
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []  # no temporary directory left


def test_the_cli_exports_and_reports_errors_in_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    run = byte_run(1, seed=5)
    ckpt = write_checkpoint(tmp_path / "ckpt", run, trained_model(run), [0])
    for args, code in (([], 0), ([], 1)):  # the second run finds --out non-empty
        monkeypatch.setattr(
            sys, "argv", ["hetero-node", "export", "--checkpoint", str(ckpt), "--out", str(tmp_path / "hf"), *args]
        )
        with pytest.raises(SystemExit) as exit_info:
            main()
        assert (exit_info.value.code or 0) == code
    out, err = capsys.readouterr()
    assert f"exported run {run.run_id} round 3" in out
    assert err.strip().startswith("error: --out") and "--force" in err and len(err.strip().splitlines()) == 1
