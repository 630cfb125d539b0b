"""The memory plan, parameter counts, checkpoint size and preflight checks of
drafter.objective dspark: one more H-vector per token from target to drafter, every target layer
run, DSpark's heads on AdamW and its loss chunk; worked out by hand against DFlash's plan."""

from __future__ import annotations

import pytest
import torch

from dflash_core.config import ConfigError, config_from_dict
from dflash_core.families import dspark as dspark_family
from dflash_core.families import registry as drafter_objective
from dflash_core.families.registry import settings as dspark_settings
from dflash_core.models.registry import new_drafter
from dflash_core.models.dspark.drafter import DSparkSettings
from dflash_core.models.target.shape import drafter_matrix_param_count, drafter_param_count
from dflash_core.checkpoint import size as checkpoint_size
from dflash_core.planning import capacity_checks, drafter_checks
from dflash_core.families.dspark import LOSS_BYTES_PER_LOGIT as DSPARK_LOSS_BYTES_PER_LOGIT
from dflash_core.planning.drafter_memory import DSPARK_HEADS
from dflash_core.planning.memory import cuda_margin, plan_memory
from dflash_core.units import GiB

from ..models.target.test_model_shape import QWEN36_27B
from .test_memory import GPU96, H, K, T, V, node


def dspark(cfg, **keys):
    """The config with drafter.objective dspark (and DSpark's other keys) set on it."""
    cfg.drafter.objective = "dspark"
    for k, v in keys.items():
        setattr(cfg.drafter, k, v)
    return cfg


def test_defaults_are_the_reference_settings():
    s = DSparkSettings()
    assert (s.block_size, s.markov_rank, s.gamma) == (
        dspark_family.BLOCK_SIZE, dspark_family.MARKOV_RANK,
        dspark_family.GAMMA)
    assert (s.ce_weight, s.tv_weight, s.conf_weight) == dspark_family.LOSS_WEIGHTS


def test_a_config_without_the_key_is_dspark_and_dflash_has_no_heads():
    assert drafter_objective.objective(config_from_dict({})) == "dspark"
    cfg = config_from_dict({"drafter": {"objective": "dflash"}})
    assert drafter_objective.objective(cfg) == "dflash" and dspark_settings(cfg) is None
    assert drafter_objective.feature_vectors(cfg, 5) == 5
    assert drafter_objective.head_params(cfg, H, V) == 0
    cfg = dspark(config_from_dict({"drafter": {"block_size": 7, "gamma": 0}}), markov_rank=64,
                 conf_weight=0.0)
    s = dspark_settings(cfg)
    assert (s.block_size, s.markov_rank, s.gamma, s.conf_weight) == (7, 64, 4.0, 0.0)
    assert not s.confidence_head
    assert drafter_objective.head_params(cfg, H, V) == 2 * 64 * V  # no confidence head
    cfg.drafter.objective = "eagle"
    with pytest.raises(ValueError, match="drafter.objective 'eagle'"):
        dspark_settings(cfg)


def test_the_27b_node_plan_of_dspark_by_hand():
    """Against DFlash's plan of the same config: the target's features and queued batches carry
    K+1 vectors instead of K, the drafter receives K+1, holds the heads' fp32 masters, gradients
    and AdamW moments in a row of their own, and a DSpark loss chunk."""
    # one sequence a pass (3584 block tokens): the loss peaks (with 18 sequences of 3072 a pass,
    # the backward over their context holds more than DSpark's small chunk)
    flash = plan_memory(node(block_size=7, micro_block_tokens=4096), QWEN36_27B, GPU96, GPU96)
    spark = plan_memory(dspark(node(block_size=7, loss_chunk=1024, micro_block_tokens=4096)),
                        QWEN36_27B, GPU96, GPU96)
    assert spark.drafter_peak == "loss"
    ft, st = flash.row("cuda:0").components, spark.row("cuda:0").components
    assert st["features"] == T * (K + 1) * H * 2 == ft["features"] * (K + 1) // K
    assert st["hs queue"] == 2 * st["features"]
    # default layer ids end at 61 of 64: DSpark runs the three after it too (no new layer
    # kind in them, so the same transient)
    assert st["layer transient"] == ft["layer transient"]
    fd, sd = flash.row("cuda:7").components, spark.row("cuda:7").components
    assert sd["received features"] == fd["received features"] * (K + 1) // K
    heads = 2 * 256 * V + (H + 256 + 1)
    assert sd[DSPARK_HEADS] == heads * 16  # 1.9 GiB: W1, W2 [V, 256] and the one-row head
    assert sd[DSPARK_HEADS] / GiB == pytest.approx(1.894, abs=0.01)
    assert sd["drafter fp32+adam"] == fd["drafter fp32+adam"]
    assert sd["autocast copies"] == fd["autocast copies"] + heads * 2
    assert sd["loss chunk"] == 1024 * V * DSPARK_LOSS_BYTES_PER_LOGIT  # 4.3 GiB
    for row in (spark.row("cuda:0"), spark.row("cuda:7")):
        tensors = {k: v for k, v in row.components.items() if k not in cuda_margin(0)}
        assert row.components == tensors | cuda_margin(sum(tensors.values()))


def test_dspark_runs_every_target_layer():
    """With the chosen layers all in the first half, DFlash's target stops there; DSpark's runs
    to the end, so a layer kind found only later (a full-attention layer of a hybrid) counts."""
    flash = node(block_size=7)
    flash.target.layer_ids = [0, 1]  # Gated DeltaNet layers of the 27B's 3:1 pattern
    spark = dspark(node(block_size=7))
    spark.target.layer_ids = [0, 1]
    ft = plan_memory(flash, QWEN36_27B, GPU96, GPU96).row("cuda:0").components
    st = plan_memory(spark, QWEN36_27B, GPU96, GPU96).row("cuda:0").components
    assert st["layer transient"] > ft["layer transient"]


def test_dspark_loss_chunk_is_the_lever_it_was():
    """drafter.loss_chunk shrinks DSpark's chunk too, at DSpark's bytes per logit."""
    big = plan_memory(dspark(node(block_size=7, loss_chunk=4096)), QWEN36_27B, GPU96, GPU96)
    assert big.row("cuda:7").components["loss chunk"] / GiB == pytest.approx(17.05, abs=0.01)


@pytest.mark.parametrize("optim", ["adamw", "muon"])
def test_counts_match_a_built_dspark_drafter(optim):
    """drafter_param_count / the Muon share and the checkpoint size of a built DSpark drafter:
    what the plan says before anything loads is what the run counts after."""
    from transformers import Qwen3Config

    hf = Qwen3Config(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=6,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                     tie_word_embeddings=False).to_dict()
    cfg = dspark(config_from_dict({"drafter": {"num_layers": 2, "block_size": 5},
                                   "target": {"layer_ids": [1, 3]},
                                   "optim": {"name": optim}}), markov_rank=16)
    d = new_drafter("dspark", Qwen3Config(**hf), num_layers=2, target_layer_ids=[1, 3],
                    block_size=0, mask_token_id=299, settings=dspark_settings(cfg))
    state = d.state_dict()
    assert sum(p.numel() for p in d.parameters()) == drafter_param_count(cfg, hf)
    params, matrices = checkpoint_size.state_counts(state, d.adamw_only)
    assert (params, matrices) == checkpoint_size.drafter_counts(cfg, hf)
    assert matrices == drafter_matrix_param_count(cfg, hf)
    assert checkpoint_size.state_counts(state)[1] - matrices == 2 * 16 * 300 + 64 + 16
    from dflash_core.models.training.optimizers import split_params
    if optim == "muon":
        muon, _ = split_params(d, list(d.parameters()))
        assert sum(p.numel() for p in muon) == matrices
    frozen = checkpoint_size.frozen_count(cfg, hf)
    from dflash_core.models.dspark import format as dspark_format
    assert frozen == dspark_format.frozen_numel(d.config) == 2 * 300 * 64
    size = checkpoint_size.checkpoint_bytes(params, matrices, 2, optim, frozen)
    assert size - checkpoint_size.checkpoint_bytes(params, matrices, 2, optim) == frozen * 2


def test_checkpoint_disk_counts_the_frozen_copies(tmp_path):
    """preflight's checkpoint line for DSpark includes the served embedding and lm_head."""
    said = []
    cfg = dspark(node(block_size=7))
    cfg.checkpoint.keep, cfg.checkpoint.every = 1, 0
    capacity_checks.check_checkpoint_disk(cfg, QWEN36_27B, tmp_path, 10, said.append)
    params, matrices = checkpoint_size.drafter_counts(cfg, QWEN36_27B)
    size = checkpoint_size.checkpoint_bytes(params, matrices, torch.bfloat16.itemsize, "adamw",
                                            2 * V * H)
    assert said[0].message.startswith(f"checkpoints: a checkpoint is {checkpoint_size.gib(size)}")


@pytest.mark.parametrize("keys, key, words", [
    ({"markov_rank": 300_000}, "drafter.markov_rank", "exceeds the target's vocabulary"),
    ({"markov_rank": 0}, "drafter.markov_rank", "rank of at least 1"),
    ({"tv_weight": -1.0}, "drafter.ce_weight", "(CE, TV, confidence) do not fit"),
    ({"ce_weight": 0.0, "tv_weight": 0.0}, "drafter.ce_weight", "CE + TV must be positive"),
])
def test_dspark_settings_that_cannot_work_are_one_line(keys, key, words):
    cfg = dspark(node(block_size=7), **keys)
    with pytest.raises(ConfigError) as exc:
        drafter_checks.check_family(cfg, V)
    assert exc.value.key == key and words in str(exc.value)
    assert "\n" not in str(exc.value) and key in exc.value.hint


def test_dspark_refuses_dpace():
    cfg = dspark(node(block_size=7))
    cfg.drafter.loss = "dpace"
    with pytest.raises(ConfigError, match="dpace does not combine") as exc:
        drafter_checks.check_family(cfg, V)
    assert exc.value.key == "drafter.loss"
    drafter_checks.check_family(node(), V)  # DFlash: nothing to check here
