"""On paper: each GPU's share of the targets users want drafters for, split over a target group
(docs/targets.md, "Targets larger than one GPU"), on 8 x 96 GB and 8 x 141 GB cards, in bf16 and
as their FP8 block-wise releases (kept FP8: 1 byte a weight and a float32 scale per 128 x 128
block), and which tensor-parallel sizes (target.parallel: shared) their FP8 blocks allow.

From the releases' shapes (their config.json's sizing keys), with the memory plan's own terms:
the weight counts (planning/weight_bytes.py), one rank's share of them under the sharded split
(planning/target_memory.group_share: weights and experts over k, one layer gathered, the rank's
CUDA context) and the FP8 weight the engine's linear dequantizes at a time. Activations are left
out (they depend on data.token_budget; preflight adds them): a copy "fits" when its per-GPU share
leaves at least HEADROOM of the card for them. The tensor-parallel column runs preflight's checks
(target_group/split.check_split, fp8_split.check_fp8_split: transformers' own plan, read on a
model built on the meta device).

    python bench/target/group_weights.py
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from dflash_core.config import ConfigError, config_from_dict  # noqa: E402
from dflash_core.models.target.shape import model_shape  # noqa: E402
from dflash_core.planning.target_memory import group_share  # noqa: E402
from dflash_core.planning.weight_bytes import (  # noqa: E402
    fp8_dequantized_weight_bytes, target_weight_parts,
)
from dflash_core.target_group.fp8_split import check_fp8_split  # noqa: E402
from dflash_core.target_group.split import SHARED, GroupSplit, check_split  # noqa: E402

GB = 1e9
HEADROOM = 0.25  # of the card kept for activations, features and the allocator
FP8 = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128],
       "activation_scheme": "dynamic"}

QWEN3_235B_A22B = dict(  # Qwen3-235B-A22B (-Instruct-2507 / -Thinking-2507 alike)
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
DEEPSEEK_V3 = dict(  # DeepSeek-V3, V3.1 and R1 share it
    model_type="deepseek_v3", vocab_size=129280, hidden_size=7168, intermediate_size=18432,
    moe_intermediate_size=2048, num_hidden_layers=61, num_attention_heads=128,
    num_key_value_heads=128, n_routed_experts=256, n_shared_experts=1, num_experts_per_tok=8,
    first_k_dense_replace=3, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
    qk_rope_head_dim=64, v_head_dim=128, n_group=8, topk_group=4, tie_word_embeddings=False)
KIMI_K2 = dict(DEEPSEEK_V3, vocab_size=163840, num_attention_heads=64, num_key_value_heads=64,
               n_routed_experts=384, first_k_dense_replace=1, n_group=1, topk_group=1)

# (name, shape, FP8 as published): each in bf16 and, where released so, as FP8 kept FP8
TARGETS = [("Qwen3-235B-A22B", QWEN3_235B_A22B), ("GLM-4.6", GLM_4_6),
           ("DeepSeek-V3 / R1", DEEPSEEK_V3), ("Kimi-K2", KIMI_K2)]
CARDS = [("96 GB", 95.6 * 2**30), ("141 GB", 139.7 * 2**30)]  # what the cards offer
SIZES = (2, 4, 8)


def plan_config(k: int):
    return config_from_dict({"layout": {"device": "cuda", "targets": list(range(8)),
                                        "drafters": [0]},
                             "target": {"gpus_per_copy": k}})


def per_gpu(config: dict, fp8: bool, k: int) -> int:
    """A sharded rank's planned bytes before activations (no features in flight)."""
    parts = target_weight_parts(config, "bfloat16", quantized=fp8)
    share = group_share(plan_config(k), model_shape(config), parts, 0, on_cuda=True)
    dequantized = fp8_dequantized_weight_bytes(config, "bfloat16", experts=True) if fp8 else 0
    return sum(share.values()) + dequantized


def tensor_parallel(config: dict) -> str:
    """The shared sizes of SIZES preflight accepts, and why the others are refused."""
    shape = model_shape(config)
    ok, refused = [], []
    for k in SIZES:
        split = GroupSplit(k, SHARED, expert_parallel=True)
        try:
            check_split(split, shape, quant="fp8" if "quantization_config" in config else None)
            check_fp8_split(split, shape, config)
            ok.append(str(k))
        except ConfigError as err:  # the refusal's words, shortened
            why = err.message.removeprefix(f"tensor parallel over {k} GPUs").lstrip(": ")
            refused.append(f"{k}: {why.split(', not a multiple')[0].split(' (and')[0]}")
    return ", ".join(ok) + (f" (refused {'; '.join(refused)})" if refused else "")


def main() -> None:
    print("| target | weights in all | per GPU, k=4 | per GPU, k=8 | 8 x 96 GB | 8 x 141 GB | "
          "shared (TP) sizes |")
    print("|---|---|---|---|---|---|---|")
    for name, shape in TARGETS:
        for fp8 in (True, False):
            config = dict(shape, quantization_config=FP8) if fp8 else shape
            parts = target_weight_parts(config, "bfloat16", quantized=fp8)
            total = parts["weights"] + parts["experts"]
            cells = []
            for _, card in CARDS:
                fit = next((k for k in SIZES if per_gpu(config, fp8, k) <= (1 - HEADROOM) * card),
                           None)
                if fit is None:
                    cells.append("does not fit")
                    continue
                free = (card - per_gpu(config, fp8, fit)) / GB
                cells.append(f"k = {fit}, {8 - fit} GPUs left for drafters" if fit < 8 else
                             f"k = 8, drafters beside the ranks ({free:.0f} GB left on each GPU)")
            label = f"{name} ({'FP8 kept' if fp8 else 'bf16'})"
            print(f"| {label} | {total / GB:.0f} GB | {per_gpu(config, fp8, 4) / GB:.0f} GB | "
                  f"{per_gpu(config, fp8, 8) / GB:.0f} GB | {cells[0]} | {cells[1]} | "
                  f"{tensor_parallel(config)} |")


if __name__ == "__main__":
    main()
