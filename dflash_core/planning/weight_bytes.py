"""What a target's weights take on a GPU, from its config alone: bytes per dtype, and the bytes
a quantized checkpoint holds where transformers runs it as stored (FP8 block-wise, MXFP4), with the
routed experts and their router apart from the rest (the memory plan's "experts" row)."""

from __future__ import annotations

import math
from typing import Any

from dflash_core.models.target.shape import Ledger, param_ledger, text_config

FP32_BYTES = 4  # softmax / norms / losses upcast to float32; FP8 scales
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
# Quantized weights as transformers holds them on a GPU that runs them:
FP8_BYTES = 1  # float8_e4m3 weight, plus one float32 scale_inv per weight_block_size block
MXFP4_BYTES = 0.5 + 1 / 32  # 4-bit values in uint8 pairs, one uint8 scale per 32 values
# What an FP8 block-wise checkpoint (Qwen's, DeepSeek's) quantizes: every linear layer's weight
# but the embeddings, the lm_head and the router; gpt-oss's MXFP4 quantizes the routed experts.
FP8_GROUPS = ("attention", "linear_attention", "mlp", "shared_experts", "experts")
MXFP4_GROUPS = ("experts",)
EXPERT_COMPONENT = ("experts", "router")  # the plan's "experts" row; the rest is "weights"
ROUTER_MIN_BYTES = FP32_BYTES  # DeepSeek-V3 / GLM-4.5 keep their router in float32


def dtype_bytes(dtype: Any) -> int:
    """Bytes per element of "bfloat16" / "float16" / "float32" or a torch dtype."""
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPE_BYTES:
        raise ValueError(f"unsupported dtype {dtype!r}; choose one of {list(DTYPE_BYTES)}")
    return DTYPE_BYTES[name]


def quantization(hf_config: dict) -> dict:
    """The checkpoint's ``quantization_config`` (top level, or in a nested text config); {} for
    weights stored in a plain dtype."""
    q = hf_config.get("quantization_config") or text_config(hf_config).get("quantization_config")
    return q if isinstance(q, dict) else {}


def quant_method(hf_config: dict) -> str | None:
    return quantization(hf_config).get("quant_method") or None


def target_weight_bytes(hf_config: dict, dtype: Any, quantized: bool = False) -> int:
    """Bytes of the target's weights in ``dtype``; with ``quantized``, as its checkpoint holds
    them (FP8 / MXFP4 kept as stored: transformers runs them on this device)."""
    return sum(target_weight_parts(hf_config, dtype, quantized).values())


def target_weight_parts(hf_config: dict, dtype: Any, quantized: bool = False) -> dict[str, int]:
    """{"weights": bytes, "experts": bytes}: the routed experts and their router apart from the
    rest (embeddings, attention, dense MLPs, shared experts, norms; a vision tower loaded with the
    language model). See target_weight_bytes for ``quantized``."""
    led = param_ledger(hf_config)
    b = dtype_bytes(dtype)
    method = quant_method(hf_config) if quantized else None
    parts = {"weights": 0, "experts": 0}
    for group, n in led.groups().items():
        part = "experts" if group in EXPERT_COMPONENT else "weights"
        if method == "fp8" and group in FP8_GROUPS:
            parts[part] += _fp8_bytes(led, group, hf_config) + led.vectors[group] * b
        elif method == "mxfp4" and group in MXFP4_GROUPS:
            matrices = n - led.vectors[group]
            parts[part] += math.ceil(matrices * MXFP4_BYTES) + led.vectors[group] * b
        elif group == "router":
            parts[part] += n * max(b, ROUTER_MIN_BYTES)
        else:
            parts[part] += n * b
    return parts


def _fp8_bytes(led: Ledger, group: str, hf_config: dict) -> int:
    """A group's weight matrices in FP8 with one float32 scale per block (a per-tensor scale when
    the config names no block size)."""
    block = quantization(hf_config).get("weight_block_size") or None
    total = 0
    for rows, cols, copies in led.matrices[group]:
        scales = math.ceil(rows / block[0]) * math.ceil(cols / block[1]) if block else 1
        total += copies * (rows * cols * FP8_BYTES + scales * FP32_BYTES)
    return total


def fp8_dequantized_weight_bytes(hf_config: dict, dtype: Any, experts: bool = False) -> int:
    """What a forward holds beside FP8 weights kept FP8: the engine's FP8 linear
    (models/target/fp8.BlockFP8Linear) dequantizes one weight at a time, a float32 and a
    ``dtype`` copy of it; the largest dense FP8 matrix counts, and with ``experts`` (a target
    group's ranks, models/target/fp8_group.py, which run one routed expert at a time) the largest
    expert matrix too; one process never runs routed experts there. Whole matrices: an upper
    bound for a tensor-parallel rank, which dequantizes its slice. transformers' kernels quantize
    the activations instead, a byte per input value, less than the layer's own activations. 0
    for a checkpoint that is not FP8."""
    if quant_method(hf_config) != "fp8":
        return 0
    led = param_ledger(hf_config)
    largest = max((rows * cols for group in FP8_GROUPS if experts or group != "experts"
                   for rows, cols, _ in led.matrices[group]), default=0)
    return largest * (FP32_BYTES + dtype_bytes(dtype))


def full_logits_bytes(tokens: int, vocab: int, dtype: Any = "bfloat16") -> int:
    """Full lm_head logits of a batch. HF's loss path (when labels are passed) also upcasts them
    with ``logits.float()``: call again with "float32" for that extra copy."""
    return tokens * vocab * dtype_bytes(dtype)
