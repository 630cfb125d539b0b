"""The memory plan's loss term under drafter.fused_loss: what the fused kernels hold (one chunk's
logits in the lm_head's dtype, DSpark three, and the rows' gradients from forward to backward),
worked out by hand at the real node's shape; auto plans what the run will do there."""

from __future__ import annotations

import pytest

from dflash_core.families.dspark import LOSS_BYTES_PER_LOGIT as DSPARK_LOSS_BYTES_PER_LOGIT
from dflash_core.models.fused_loss import select
from dflash_core.planning.memory import plan_memory
from dflash_core.units import GiB

from ..models.target.test_model_shape import QWEN36_27B
from .test_memory import GPU96, H, V, node
from .test_memory_dspark import dspark


def loss_term(cfg) -> int:
    return plan_memory(cfg, QWEN36_27B, GPU96, GPU96).row("cuda:7").components["loss chunk"]


def test_the_fused_dflash_term_is_one_bf16_chunk_and_the_rows_gradients():
    # micro_block_tokens 8192 (config.yaml's): one sequence of 512 anchors x 16 per pass
    rows = 512 * 16
    torch_path = loss_term(node(micro_block_tokens=8192))
    fused = loss_term(node(micro_block_tokens=8192, fused_loss="on"))
    assert torch_path == 4096 * V * 8  # 7.6 GiB: float32 logits and their gradient
    assert fused == 4096 * V * 2 + rows * H * 2  # a bf16 buffer the gradient overwrites
    assert fused / GiB == pytest.approx(1.97, abs=0.01) and fused < torch_path / 3


def test_the_fused_dspark_term_is_three_chunks_the_rows_and_the_markov_gradient():
    rows, r = 512 * 7 * 2, 256  # micro_block_tokens 8192 holds two sequences at B 7
    cfg = dspark(node(block_size=7, loss_chunk=1024, micro_block_tokens=8192))
    torch_path = loss_term(cfg)
    cfg.drafter.fused_loss = "on"
    fused = loss_term(cfg)
    assert torch_path == 1024 * V * DSPARK_LOSS_BYTES_PER_LOGIT  # 4.3 GiB
    assert fused == 3 * 1024 * V * 2 + rows * (H + r) * 2 + V * r * (4 + 2 * 2)
    assert fused / GiB == pytest.approx(1.97, abs=0.01) and fused < torch_path / 2


def test_auto_plans_what_the_run_will_do(monkeypatch):
    monkeypatch.setattr(select, "triton_installed", lambda: True)
    fused = loss_term(node(micro_block_tokens=8192, fused_loss="auto"))
    assert fused == loss_term(node(micro_block_tokens=8192, fused_loss="on"))
    monkeypatch.setattr(select, "triton_installed", lambda: False)
    assert loss_term(node(micro_block_tokens=8192, fused_loss="auto")) == 4096 * V * 8
    # a CPU run never fuses: its plan is the torch loss's even with on (refused at preflight)
    cpu = node(micro_block_tokens=8192, fused_loss="on")
    cpu.layout.device = "cpu"
    comps = plan_memory(cpu, QWEN36_27B).rows[0].components
    assert comps["loss chunk"] == 4096 * V * 8
