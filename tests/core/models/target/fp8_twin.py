"""A tiny dense target written twice: as an FP8 block-wise checkpoint laid out as Qwen's and
DeepSeek's FP8 releases are (each attention and MLP projection's ``weight`` in float8_e4m3fn with
its float32 ``weight_scale_inv``, one per 128 x 128 block; embeddings, lm_head and norms bf16;
config.json's ``quantization_config`` names fp8 and the block), and as its bf16 twin holding the
weights the FP8 ones stand for. The CPU and GPU tests of FP8 targets load both."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import transformers as tf
from safetensors.torch import save_file

from dflash_core.models.target.fp8 import dequantize_blockwise, quantize_blockwise

BLOCK = (128, 128)
FP8_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
              "weight_block_size": list(BLOCK)}
# every width a multiple of 128: transformers reads the block from the scale grid
TINY_QWEN3 = dict(vocab_size=512, hidden_size=256, intermediate_size=384, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                  tie_word_embeddings=False, max_position_embeddings=512)
LAYERS = TINY_QWEN3["num_hidden_layers"]


def quantized(name: str) -> bool:
    """The tensors an FP8 block-wise release stores in FP8: the projections' weights."""
    return name.endswith("_proj.weight") and ".layers." in name


def write_fp8_twin(folder: Path, seed: int = 0, std: float = 0.05) -> tuple[Path, Path]:
    """(FP8 folder, bf16 twin folder) under ``folder`` of a tiny Qwen3 of random weights."""
    torch.manual_seed(seed)
    config = tf.Qwen3Config(**TINY_QWEN3, initializer_range=std)
    model = tf.Qwen3ForCausalLM(config)
    fp8, twin = {}, {}
    for name, p in model.state_dict().items():
        if quantized(name):
            q, scale = quantize_blockwise(p.detach(), BLOCK)
            fp8[name], fp8[name + "_scale_inv"] = q, scale
            twin[name] = dequantize_blockwise(q, scale, BLOCK, torch.bfloat16)
        else:
            fp8[name] = twin[name] = p.detach().to(torch.bfloat16)
    paths = folder / "fp8", folder / "bf16"
    for path, tensors, quant in ((paths[0], fp8, FP8_CONFIG), (paths[1], twin, None)):
        path.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
        hf = config.to_dict() | {"torch_dtype": "bfloat16"}
        if quant:
            hf["quantization_config"] = quant
        (path / "config.json").write_text(json.dumps(hf))
    return paths
