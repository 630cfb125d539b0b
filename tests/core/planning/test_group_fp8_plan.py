"""The memory plan of an FP8 block-wise target in a target group: each rank's share counts the
weights and experts as the checkpoint stores them (a byte a value, a float32 scale per block),
over the group's k GPUs; the weight the engine's FP8 linear dequantizes may be a routed expert's
there; routed experts stay FP8 in a group without transformers' kernels (the ranks' own matmul
runs them), where one process dequantizes them. DeepSeek-V3's published shape."""

from __future__ import annotations

import math

import pytest
import torch

from dflash_core.config import config_from_dict
from dflash_core.models.target.shape import model_shape, param_ledger
from dflash_core.planning.quantized_check import quantized_weights
from dflash_core.planning.target_memory import target_tensors
from dflash_core.planning.weight_bytes import target_weight_parts
from dflash_core.units import GiB

from ..models.target.target_classes import DEEPSEEK_V3

FP8 = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
       "weight_block_size": [128, 128]}
DEEPSEEK_V3_FP8 = dict(DEEPSEEK_V3, quantization_config=FP8)


def group_cfg(k: int, parallel: str = "sharded"):
    return config_from_dict({"layout": {"device": "cuda", "targets": list(range(8)),
                                        "drafters": [0]},
                             "target": {"gpus_per_copy": k, "parallel": parallel}})


@pytest.mark.parametrize("parallel", ["sharded", "shared"])
def test_a_rank_holds_its_share_of_the_fp8_bytes(parallel):
    cfg = group_cfg(8, parallel)
    row = target_tensors(cfg, DEEPSEEK_V3_FP8, on_cuda=True, quantized=True)
    parts = target_weight_parts(DEEPSEEK_V3_FP8, "bfloat16", quantized=True)
    assert row["weights"] == math.ceil(parts["weights"] / 8)
    assert row["experts"] == math.ceil(parts["experts"] / 8)
    # the experts as stored: 256 x 58 layers x 3 matrices of 2048 x 7168 FP8 values, each with a
    # float32 scale per 128 x 128 block (the router in float32 beside them)
    s = model_shape(DEEPSEEK_V3_FP8)
    moe_layers = s.layers - 3
    values = moe_layers * s.experts * 3 * 2048 * 7168
    scales = moe_layers * s.experts * 3 * (2048 // 128) * (7168 // 128)
    router = param_ledger(DEEPSEEK_V3_FP8).groups()["router"] * 4
    assert parts["experts"] == values + 4 * scales + router
    # in bf16 the rank's experts alone would not fit a 96 GB card; kept FP8 they take 76 GiB
    plain = target_weight_parts(DEEPSEEK_V3, "bfloat16")
    assert plain["experts"] / 8 > 96e9 > row["experts"]
    assert row["experts"] / GiB == pytest.approx(76.2, abs=0.1)
    if parallel == "sharded":  # one layer's dense part gathered whole while it runs
        assert row["gathered layer"] == math.ceil(parts["weights"] / s.layers)


def test_the_dequantized_weight_of_a_rank_may_be_an_experts():
    """One process never runs routed experts on the engine's FP8 linear; a rank does, one expert
    at a time: the largest of its matrices counts too (a model whose experts are the widest)."""
    wide = dict(DEEPSEEK_V3_FP8, moe_intermediate_size=24576)
    led = param_ledger(wide)
    expert = max(r * c for r, c, _ in led.matrices["experts"])
    dense = max(r * c for g in ("attention", "mlp", "shared_experts")
                for r, c, _ in led.matrices[g])
    assert expert > dense
    one = target_tensors(config_from_dict({"layout": {"device": "cuda"}}), wide, True, True)
    ranks = target_tensors(group_cfg(8), wide, True, True)
    assert one["FP8 weight dequantized"] == dense * (4 + 2)
    assert ranks["FP8 weight dequantized"] == expert * (4 + 2)


def test_routed_experts_stay_fp8_in_a_group_without_transformers_kernels(monkeypatch):
    from dflash_core.models.target import fp8

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (9, 0))
    monkeypatch.setattr(fp8, "kernels_installed", lambda: False)
    devices = [torch.device("cuda", i) for i in range(8)]
    kept, line = quantized_weights(group_cfg(8), DEEPSEEK_V3_FP8, devices)
    assert kept and "stay as stored" in line and "run by the engine's FP8 linear" in line
    alone, line = quantized_weights(config_from_dict({"layout": {"device": "cuda"}}),
                                    DEEPSEEK_V3_FP8, devices[:1])
    assert not alone and "routed experts run only on transformers' FP8 kernels" in line
