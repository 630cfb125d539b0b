"""On paper: each GPU's share of the targets users want drafters for, split over a target group
(docs/targets.md, "Targets larger than one GPU"), on 8 x 96 GB and 8 x 141 GB cards.

From the releases' shapes (their config.json's sizing keys), with the memory plan's own weight
counts (planning/weight_bytes.py) and its rank terms (planning/target_memory.group_share): the
weights and experts over k, one layer gathered whole (sharded), a CUDA context per process.
Activations are left out here (they depend on data.token_budget; preflight adds them): a copy
"fits" when its per-GPU share leaves at least HEADROOM of the card for them.

    python bench/target/group_weights.py
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from dflash_core.models.target.shape import model_shape  # noqa: E402
from dflash_core.planning.weight_bytes import target_weight_parts  # noqa: E402

GB = 1e9
HEADROOM = 0.25  # of the card kept for activations, features and the allocator
CONTEXT = 2 * 2**30  # the plan's CUDA context of a rank's process
FP8 = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128],
       "activation_scheme": "dynamic"}

QWEN3_235B_A22B = dict(
    model_type="qwen3_moe", vocab_size=151936, hidden_size=4096, intermediate_size=12288,
    moe_intermediate_size=1536, num_hidden_layers=94, num_attention_heads=64,
    num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
    tie_word_embeddings=False)
GLM_4_6 = dict(  # GLM-4.6 keeps GLM-4.5's shape (355B-A32B); its context grew to 200K
    model_type="glm4_moe", vocab_size=151552, hidden_size=5120, intermediate_size=12288,
    moe_intermediate_size=1536, num_hidden_layers=92, num_attention_heads=96,
    num_key_value_heads=8, head_dim=128, n_routed_experts=160, n_shared_experts=1,
    num_experts_per_tok=8, first_k_dense_replace=3, attention_bias=True, use_qk_norm=True,
    partial_rotary_factor=0.5, n_group=1, topk_group=1, tie_word_embeddings=False)
DEEPSEEK_V3 = dict(
    model_type="deepseek_v3", vocab_size=129280, hidden_size=7168, intermediate_size=18432,
    moe_intermediate_size=2048, num_hidden_layers=61, num_attention_heads=128,
    num_key_value_heads=128, n_routed_experts=256, n_shared_experts=1, num_experts_per_tok=8,
    first_k_dense_replace=3, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
    qk_rope_head_dim=64, v_head_dim=128, n_group=8, topk_group=4, tie_word_embeddings=False,
    quantization_config=FP8)
KIMI_K2 = dict(DEEPSEEK_V3, vocab_size=163840, num_attention_heads=64, num_key_value_heads=64,
               n_routed_experts=384, first_k_dense_replace=1, n_group=1, topk_group=1)

TARGETS = [("Qwen3-235B-A22B (bf16)", QWEN3_235B_A22B, False),
           ("GLM-4.6 (bf16)", GLM_4_6, False),
           ("DeepSeek-V3 / R1 (FP8 kept)", DEEPSEEK_V3, True),
           ("DeepSeek-V3 / R1 (bf16)", DEEPSEEK_V3, False),
           ("Kimi-K2 (FP8 kept)", KIMI_K2, True),
           ("Kimi-K2 (bf16)", KIMI_K2, False)]
CARDS = [("96 GB", 95.6 * 2**30), ("141 GB", 139.7 * 2**30)]  # what the cards offer


def per_gpu(config: dict, fp8: bool, k: int) -> int:
    """A sharded rank's bytes before activations: weights and experts over k, one layer's
    dense weights gathered, the rank's CUDA context."""
    parts = target_weight_parts(config, "bfloat16", quantized=fp8)
    layers = model_shape(config).layers
    return (math.ceil(parts["weights"] / k) + math.ceil(parts["experts"] / k)
            + math.ceil(parts["weights"] / layers) + CONTEXT)


def main() -> None:
    print("| target | weights in all | per GPU, k=4 | per GPU, k=8 | 8 x 96 GB | 8 x 141 GB |")
    print("|---|---|---|---|---|---|")
    for name, config, fp8 in TARGETS:
        parts = target_weight_parts(config, "bfloat16", quantized=fp8)
        total = parts["weights"] + parts["experts"]
        cells = []
        for _, card in CARDS:
            fit = next((k for k in (2, 4, 8) if per_gpu(config, fp8, k) <= (1 - HEADROOM) * card),
                       None)
            if fit is None:
                cells.append("does not fit")
                continue
            free = (card - per_gpu(config, fp8, fit)) / GB
            cells.append(f"k = {fit}, {8 - fit} GPUs left for drafters" if fit < 8 else
                         f"k = 8, drafters beside the ranks ({free:.0f} GB left on each GPU)")
        print(f"| {name} | {total / GB:.0f} GB | {per_gpu(config, fp8, 4) / GB:.0f} GB | "
              f"{per_gpu(config, fp8, 8) / GB:.0f} GB | {cells[0]} | {cells[1]} |")


if __name__ == "__main__":
    main()
