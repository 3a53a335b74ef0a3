"""Modules built on the meta device (`models/meta.py`) have the real model's names and shapes, and sizing a run
with them does not import torch's compiler (1.5-4 s of every node start when it did)."""

from __future__ import annotations

import subprocess
import sys

import torch

from hetero_node.models.config import get_preset
from hetero_node.models.meta import on_meta
from hetero_node.models.transformer import Transformer


def test_a_model_built_on_meta_has_the_real_ones_names_shapes_and_buffers() -> None:
    cfg = get_preset("tiny", vocab_size=256)
    with on_meta():
        meta = Transformer(cfg)
    real = Transformer(cfg)
    assert all(p.is_meta for p in meta.parameters())
    assert {n: p.shape for n, p in meta.named_parameters()} == {n: p.shape for n, p in real.named_parameters()}
    assert {n: b.shape for n, b in meta.named_buffers()} == {n: b.shape for n, b in real.named_buffers()}
    assert torch.equal(meta.rope_cos, real.rope_cos), "the rope tables are data, computed alike"


SIZING = """
import sys
from hetero_node.client.swarm.cost_model import RunShape
from hetero_node.protocol.run_config import RunConfig
RunShape.from_run(RunConfig(preset="small", vocab_size=256, batch_size=8, seq_len=64, seed=0, data_shards=1,
                            data_identity="x", tokenizer_identity="y"))
print("torch._dynamo" in sys.modules)
"""


def test_sizing_a_run_does_not_import_torchs_compiler() -> None:
    out = subprocess.run([sys.executable, "-c", SIZING], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "False", out.stdout + out.stderr
