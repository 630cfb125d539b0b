"""Model shapes read from HF configs: exact parameter counts against transformers."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, Qwen3_5Config

from dflash_core.config import config_from_dict
from dflash_core.models.model_shape import drafter_param_count, model_shape, param_count, text_config

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures"


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
    cfg = config_from_dict({})  # L=5, k=5, target width
    text = QWEN36_27B["text_config"]
    # the drafter's layers are Qwen3 decoder layers of the target's width (no gated q)
    stack = {"model_type": "qwen3", "hidden_size": 5120, "intermediate_size": 17408,
             "num_hidden_layers": 5, "num_attention_heads": 24, "num_key_value_heads": 4,
             "head_dim": 256, "vocab_size": 8}
    layers_and_norm = hf_param_count(stack, AutoModel) - 8 * 5120  # minus its tiny embedding
    fc, hidden_norm = 5 * text["hidden_size"] * 5120, 5120
    assert drafter_param_count(cfg, QWEN36_27B) == layers_and_norm + fc + hidden_norm
    assert drafter_param_count(cfg, QWEN36_27B) == 1_835_072_000


def test_moe_targets_are_refused():
    with pytest.raises(ValueError, match="mixture-of-experts"):
        param_count(scaled(QWEN3_8B, num_experts=8))
