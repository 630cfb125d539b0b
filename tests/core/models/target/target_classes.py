"""Tiny random-weight targets of each architecture class the engine supports (the configs
transformers' own classes build, so their structure is the real one), and the real releases'
shapes for the counts that need full size.

``TINY[name]()`` gives a transformers config; ``build(name)`` a seeded model of it in eval mode.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import transformers as tf

VOCAB, HIDDEN, LAYERS = 256, 64, 4
SMALL = dict(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, tie_word_embeddings=False,
             max_position_embeddings=512)
GDN = dict(linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2,
           linear_num_value_heads=4)
ROUTED = dict(moe_intermediate_size=32, num_experts_per_tok=2)
MLA = dict(kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16)


def _gemma3() -> tf.Gemma3Config:
    return tf.Gemma3Config(
        text_config=dict(SMALL, intermediate_size=128, sliding_window=8),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                           num_attention_heads=2, image_size=16, patch_size=4),
        mm_tokens_per_image=4, image_token_index=VOCAB - 1, boi_token_index=VOCAB - 3,
        eoi_token_index=VOCAB - 2)


def _qwen3_5_moe() -> tf.Qwen3_5MoeConfig:
    return tf.Qwen3_5MoeConfig(
        text_config=dict(SMALL, **GDN, **ROUTED, shared_expert_intermediate_size=48,
                         num_experts=8),
        vision_config=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2,
                           out_hidden_size=HIDDEN, patch_size=4, num_position_embeddings=16),
        image_token_id=VOCAB - 1, video_token_id=VOCAB - 2, vision_start_token_id=VOCAB - 3,
        vision_end_token_id=VOCAB - 4)


TINY = {
    # Qwen3-30B-A3B / Qwen3-Coder-30B-A3B class: every layer routed, a dense width kept beside
    "qwen3_moe": lambda: tf.Qwen3MoeConfig(**SMALL, **ROUTED, intermediate_size=128,
                                           num_experts=8),
    # Qwen3.5 / 3.6-35B-A3B class: Gated DeltaNet + gated attention, routed + one shared expert
    "qwen3_5_moe_text": lambda: tf.Qwen3_5MoeTextConfig(**SMALL, **GDN, **ROUTED, num_experts=8,
                                                        shared_expert_intermediate_size=48),
    "qwen3_5_moe": _qwen3_5_moe,  # the image-text release's config, loaded as its text model
    # gpt-oss-20b / 120b class: biased router and experts, attention sinks, sliding layers
    "gpt_oss": lambda: tf.GptOssConfig(**{**SMALL, "max_position_embeddings": 131072},
                                       intermediate_size=32, num_local_experts=8,
                                       num_experts_per_tok=2, sliding_window=8),
    # DeepSeek-V3 class (Kimi-K2's shape too): MLA, first layer dense, a shared expert
    "deepseek_v3": lambda: tf.DeepseekV3Config(
        # head_dim is the rope part of a head, as transformers takes it when the file names none
        **{**SMALL, "num_key_value_heads": 4, "head_dim": MLA["qk_rope_head_dim"]}, **MLA,
        **ROUTED, intermediate_size=128,
        n_routed_experts=8, n_shared_experts=1, first_k_dense_replace=1, n_group=2,
        topk_group=1),
    # GLM-4.5 class: q/k/v biases, q/k norms, first layer dense, a shared expert
    "glm4_moe": lambda: tf.Glm4MoeConfig(**SMALL, **ROUTED, intermediate_size=128,
                                         n_routed_experts=8, n_shared_experts=1,
                                         first_k_dense_replace=1, n_group=1, topk_group=1,
                                         attention_bias=True, use_qk_norm=True),
    # the multimodal wrapper that transformers loads whole: the decoder is one level deeper
    "gemma3": _gemma3,
}
MOE = ["qwen3_moe", "qwen3_5_moe_text", "qwen3_5_moe", "gpt_oss", "deepseek_v3", "glm4_moe"]
# The dense classes (build() makes them too; the tests above iterate TINY alone)
DENSE = {
    "qwen3": lambda: tf.Qwen3Config(**SMALL, intermediate_size=128),
    "llama": lambda: tf.LlamaConfig(**SMALL, intermediate_size=128),
    "mistral": lambda: tf.MistralConfig(**SMALL, intermediate_size=128),
    "qwen3_5_text": lambda: tf.Qwen3_5TextConfig(**SMALL, **GDN, intermediate_size=128),
    "gemma3_text": lambda: tf.Gemma3TextConfig(**SMALL, intermediate_size=128, sliding_window=8),
}
CLASSES = {**DENSE, **TINY}


def build(name: str, seed: int = 0) -> torch.nn.Module:
    """A seeded random model of ``CLASSES[name]`` as AutoModelForCausalLM builds it, in eval mode.
    Router weights get a real spread (transformers zero-initialises some), so tokens route to
    different experts as they would in a trained model."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(CLASSES[name]()).eval()
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if p.abs().sum() == 0 and p.dim() >= 2:  # zero-initialised routers, sinks, ...
                p.normal_(0, 0.5)
    return model


# The releases' shapes (the keys that size them, as in their config.json), for counts at full size.
def _fixture(name: str) -> dict:
    return json.loads((Path(__file__).resolve().parents[3] / "fixtures" / name).read_text())


QWEN3_30B_A3B = _fixture("qwen3_30b_a3b_config.json")
GPT_OSS_20B = _fixture("gpt_oss_20b_config.json")  # in bf16: the release's experts are MXFP4
DEEPSEEK_V3 = dict(
    model_type="deepseek_v3", vocab_size=129280, hidden_size=7168, intermediate_size=18432,
    moe_intermediate_size=2048, num_hidden_layers=61, num_attention_heads=128,
    num_key_value_heads=128, n_routed_experts=256, n_shared_experts=1, num_experts_per_tok=8,
    first_k_dense_replace=3, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
    qk_rope_head_dim=64, v_head_dim=128, n_group=8, topk_group=4, tie_word_embeddings=False)
GLM_4_5 = dict(
    model_type="glm4_moe", vocab_size=151552, hidden_size=5120, intermediate_size=12288,
    moe_intermediate_size=1536, num_hidden_layers=92, num_attention_heads=96,
    num_key_value_heads=8, head_dim=128, n_routed_experts=160, n_shared_experts=1,
    num_experts_per_tok=8, first_k_dense_replace=3, attention_bias=True, use_qk_norm=True,
    partial_rotary_factor=0.5, n_group=1, topk_group=1, tie_word_embeddings=False)
