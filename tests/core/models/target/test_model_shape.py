"""Model shapes read from HF configs: exact parameter counts against transformers."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, Qwen3_5Config

from dflash_core.config import config_from_dict
from dflash_core.models.target.shape import (
    drafter_intermediate, drafter_param_count, model_shape, param_count, param_ledger, text_config,
)

from .target_classes import (
    DEEPSEEK_V3, GLM_4_5, GPT_OSS_20B, MOE, QWEN3_30B_A3B, TINY, VOCAB,
)

FIXTURES = Path(__file__).resolve().parents[3] / "fixtures"


def load(name: str) -> dict:
    return json.loads((FIXTURES / name).read_text())


QWEN36_27B = load("qwen3_6_27b_config.json")
QWEN3_8B = load("qwen3_8b_config.json")


def hf_param_count(hf_config: dict, auto=AutoModelForCausalLM) -> int:
    """Parameters of the real transformers model, built on the meta device (no memory used)."""
    config = AutoConfig.for_model(**copy.deepcopy(hf_config))
    with torch.device("meta"):
        model = auto.from_config(config)
    return sum(p.numel() for p in model.parameters())  # tied weights are counted once


def scaled(hf_config: dict, **text) -> dict:
    """The same family at toy size; keys go to text_config when the config nests one."""
    d = copy.deepcopy(hf_config)
    (d["text_config"] if "text_config" in d else d).update(text)
    return d


# --------------------------------------------------------------------------------------------
# Reading a config
# --------------------------------------------------------------------------------------------

def test_text_config_of_a_dict_and_of_a_transformers_config():
    assert text_config(QWEN36_27B) is QWEN36_27B["text_config"]
    assert text_config(QWEN3_8B) is QWEN3_8B
    multimodal = Qwen3_5Config()
    assert text_config(multimodal) is multimodal.text_config
    assert text_config(multimodal.text_config) is multimodal.text_config


def test_shape_of_known_configs():
    s = model_shape(QWEN36_27B)
    assert (s.hidden, s.layers, s.heads, s.kv_heads, s.head_dim, s.vocab, s.intermediate) == (
        5120, 64, 24, 4, 256, 248320, 17408)
    assert s.layer_types[:4] == ("linear_attention",) * 3 + ("attention",)
    assert s.layer_types.count("attention") == 16
    assert model_shape(QWEN3_8B).layer_types == ("attention",) * 36


# --------------------------------------------------------------------------------------------
# Parameter counts
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("hf_config", [QWEN3_8B, QWEN36_27B], ids=["qwen3-8b", "qwen3.6-27b"])
def test_param_count_matches_transformers_at_full_size(hf_config):
    assert param_count(hf_config) == hf_param_count(hf_config)


def test_param_count_of_known_shapes():
    assert param_count(QWEN3_8B) == 8_190_735_360
    # Qwen3.6-27B, text model only; by hand:
    H, I, V = 5120, 17408, 248320
    mlp_and_norms = 3 * H * I + 2 * H
    gdn = (H * (2 * 2048 + 6144)  # in_proj_qkv: 16 key heads x 128 (q and k) + 48 x 128 (v)
           + H * 6144 + 2 * H * 48  # in_proj_z, in_proj_b, in_proj_a
           + 10240 * 4 + 2 * 48 + 128  # conv1d (kernel 4), dt_bias + A_log, gated norm
           + 6144 * H)  # out_proj
    full = H * 24 * 256 * 2 + 2 * H * 4 * 256 + 24 * 256 * H + 2 * 256  # gated q, k, v, o, q/k norm
    expected = 48 * (gdn + mlp_and_norms) + 16 * (full + mlp_and_norms) + 2 * V * H + H
    assert param_count(QWEN36_27B) == expected == 26_895_998_464


def test_param_count_scaled_down_variants_match_transformers():
    # tied embeddings, an uneven hybrid pattern, odd head counts, q/k/v biases
    hybrid = scaled(QWEN36_27B, hidden_size=64, intermediate_size=96, num_hidden_layers=5,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=300,
                    linear_num_key_heads=2, linear_num_value_heads=6, linear_key_head_dim=8,
                    linear_value_head_dim=12, linear_conv_kernel_dim=3, tie_word_embeddings=True,
                    layer_types=["linear_attention", "full_attention", "linear_attention",
                                 "linear_attention", "full_attention"])
    dense = scaled(QWEN3_8B, hidden_size=64, intermediate_size=80, num_hidden_layers=3,
                   num_attention_heads=4, num_key_value_heads=1, head_dim=24, vocab_size=200,
                   attention_bias=True, tie_word_embeddings=True)
    for cfg in (hybrid, dense):
        assert param_count(cfg) == hf_param_count(cfg)
    # layer_types may be left out: every 4th layer is full attention, as transformers derives it
    no_types = copy.deepcopy(hybrid)
    del no_types["text_config"]["layer_types"]
    no_types["text_config"]["num_hidden_layers"] = 8
    assert param_count(no_types) == hf_param_count(no_types)
    # a nested text_config is read the same as the bare text config
    assert param_count(QWEN36_27B) == param_count(QWEN36_27B["text_config"])


def test_drafter_param_count_matches_a_qwen3_stack():
    cfg = config_from_dict({"drafter": {"objective": "dflash"}})  # L=5, k=5, target width
    text = QWEN36_27B["text_config"]
    # the drafter's layers are Qwen3 decoder layers of the target's width (no gated q)
    stack = {"model_type": "qwen3", "hidden_size": 5120, "intermediate_size": 17408,
             "num_hidden_layers": 5, "num_attention_heads": 24, "num_key_value_heads": 4,
             "head_dim": 256, "vocab_size": 8}
    layers_and_norm = hf_param_count(stack, AutoModel) - 8 * 5120  # minus its tiny embedding
    fc, hidden_norm = 5 * text["hidden_size"] * 5120, 5120
    assert drafter_param_count(cfg, QWEN36_27B) == layers_and_norm + fc + hidden_norm
    assert drafter_param_count(cfg, QWEN36_27B) == 1_835_072_000


# --------------------------------------------------------------------------------------------
# Mixture of experts, latent attention, multimodal wrappers
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(TINY))
def test_param_count_of_each_target_class_matches_transformers(name):
    """Experts, routers, shared experts, MLA, gpt-oss biases and sinks, Gemma's four norms and the
    vision tower of a wrapper transformers loads whole: all counted, none twice."""
    hf_config = TINY[name]().to_dict()
    assert param_count(hf_config) == hf_param_count(hf_config)


@pytest.mark.parametrize("hf_config, total", [
    (QWEN3_30B_A3B, 30_532_122_624), (GPT_OSS_20B, 20_914_757_184),
    (DEEPSEEK_V3, 671_026_404_352), (GLM_4_5, 352_797_814_784),
], ids=["qwen3-30b-a3b", "gpt-oss-20b", "deepseek-v3", "glm-4.5"])
def test_param_count_of_moe_releases_matches_transformers_at_full_size(hf_config, total):
    # 30.5B, 20.9B and 671B are the releases' own figures (GLM-4.5's 355B has its MTP layer,
    # which transformers does not build)
    assert param_count(hf_config) == hf_param_count(hf_config) == total
    led = param_ledger(hf_config)
    assert led.group("experts") > 0.8 * led.total  # nearly all of them are expert weights


def test_which_layers_route_to_experts():
    assert model_shape(DEEPSEEK_V3).mlp_types == ("dense",) * 3 + ("moe",) * 58
    qwen = model_shape(dict(QWEN3_30B_A3B, num_hidden_layers=6, mlp_only_layers=[0],
                            decoder_sparse_step=2))
    assert qwen.mlp_types == ("dense", "moe", "dense", "moe", "dense", "moe")
    assert model_shape(QWEN3_8B).mlp_types == () and model_shape(QWEN3_8B).experts == 0
    assert model_shape(GPT_OSS_20B).moe_layers == 24


def test_moe_shapes_read_by_meaning_not_by_name():
    s = model_shape(DEEPSEEK_V3)
    assert (s.experts, s.experts_per_tok, s.expert_intermediate, s.shared_intermediate) == (
        256, 8, 2048, 2048)
    assert (s.kv_lora_rank, s.q_lora_rank, s.head_dim) == (512, 1536, 64)  # head_dim: the rope
    oss = model_shape(GPT_OSS_20B)  # its intermediate_size is one expert's; no dense layer
    assert (oss.experts, oss.expert_intermediate, oss.intermediate) == (32, 2880, 0)
    assert oss.attn_sinks and oss.expert_bias and oss.qkv_bias and oss.o_bias
    glm = model_shape(GLM_4_5)
    assert glm.qkv_bias and not glm.o_bias and glm.qk_norm
    # transformers writes Qwen3-MoE's count as num_local_experts, the release as num_experts
    assert model_shape(TINY["qwen3_moe"]().to_dict()).experts == 8


@pytest.mark.parametrize("hf_config, width", [
    (QWEN3_30B_A3B, 6144), (DEEPSEEK_V3, 18432), (GLM_4_5, 12288), (GPT_OSS_20B, 4 * 2880),
    (dict(QWEN3_30B_A3B, model_type="qwen3_5_moe_text", shared_expert_intermediate_size=512,
          moe_intermediate_size=512, intermediate_size=None), 8 * 512 + 512),
    (QWEN3_8B, 12288),
], ids=["qwen3-moe", "deepseek-v3", "glm-4.5", "gpt-oss", "qwen3.5-moe (no dense width)",
        "dense"])
def test_drafter_width_defaults_from_moe_configs(hf_config, width):
    assert drafter_intermediate(hf_config) == width
    assert model_shape(hf_config).drafter_intermediate == width


@pytest.mark.parametrize("name", MOE)
def test_drafter_built_for_a_moe_target_is_the_one_planned(name):
    """The drafter build_drafter_config makes from the target's config object has as many
    parameters as the plan and the checkpoint size count from config.json (Qwen3.5-MoE once
    crashed here: its text config has no intermediate_size)."""
    from dflash_core.models.dflash.drafter import DFlashDrafter, build_drafter_config

    config = TINY[name]()
    cfg = config_from_dict({"drafter": {"objective": "dflash", "num_layers": 2},
                            "target": {"layer_ids": [0, 1, 3]}})
    dcfg = build_drafter_config(config, num_layers=2, target_layer_ids=[0, 1, 3], block_size=4,
                                mask_token_id=VOCAB - 1)
    assert dcfg.intermediate_size == drafter_intermediate(text_config(config)) > 0
    drafter = DFlashDrafter(dcfg)
    assert sum(p.numel() for p in drafter.parameters()) == drafter_param_count(
        cfg, config.to_dict())
