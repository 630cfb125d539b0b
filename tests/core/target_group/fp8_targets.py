"""Tiny FP8 block-wise targets for target groups, and a rank whose CPU plays a GPU that keeps FP8.

The checkpoints are laid out as the FP8 releases are (Qwen's, DeepSeek's): every projection of a
decoder layer in float8_e4m3fn with a float32 ``weight_scale_inv`` per 128 x 128 block, routed
experts one tensor per expert, the rest bf16. Each width the tensor-parallel plan splits is a
multiple of 2 x 128, so a 2-way split keeps every block whole; the others fit one block or a
whole number of them (transformers' dequantization at load reads the block from the scale grid,
which a narrower last block would mislead: the one-process reference loads that way).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import transformers as tf
from safetensors.torch import save_file

from dflash_core.models.target.fp8 import dequantize_blockwise, quantize_blockwise

from ..models.target.fp8_twin import BLOCK, FP8_CONFIG

VOCAB = 512
SMALL = dict(vocab_size=VOCAB, hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
             tie_word_embeddings=False, max_position_embeddings=512)
ROUTED = dict(moe_intermediate_size=256, num_experts_per_tok=2)
CONFIGS = {
    "qwen3": lambda: tf.Qwen3Config(**SMALL, num_key_value_heads=2, head_dim=128,
                                    intermediate_size=512),
    "qwen3_moe": lambda: tf.Qwen3MoeConfig(**SMALL, **ROUTED, num_key_value_heads=2,
                                           head_dim=128, intermediate_size=512, num_experts=4),
    # multi-head latent attention, a dense first layer, a shared expert: DeepSeek-V3's structure
    "deepseek_v3": lambda: tf.DeepseekV3Config(
        **SMALL, **ROUTED, num_key_value_heads=4, head_dim=64, q_lora_rank=128, kv_lora_rank=64,
        qk_nope_head_dim=64, qk_rope_head_dim=64, v_head_dim=64, intermediate_size=512,
        n_routed_experts=4, n_shared_experts=1, first_k_dense_replace=1, n_group=2,
        topk_group=1),
}


def _quantized(name: str, p: torch.Tensor) -> bool:
    """The tensors an FP8 block-wise release stores in FP8: each decoder layer's projections."""
    return p.dim() == 2 and ".layers." in name and name.endswith(("proj.weight", "_mqa.weight"))


def write_fp8(folder: Path, name: str, seed: int = 0, std: float = 0.05, *, config=None,
              twin: Path | None = None) -> Path:
    """An FP8 block-wise checkpoint of a random ``CONFIGS[name]`` model (or ``config``, a
    transformers config) in ``folder``; with ``twin``, its bf16 twin there too (the weights the
    FP8 ones stand for, in the same layout, no quantization_config)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    config = config if config is not None else CONFIGS[name]()
    config.initializer_range = std
    model = AutoModelForCausalLM.from_config(config)
    tensors: dict[str, torch.Tensor] = {}
    plain: dict[str, torch.Tensor] = {}

    def put(key: str, w: torch.Tensor) -> None:
        q, scale = quantize_blockwise(w, BLOCK)
        tensors[key + ".weight"], tensors[key + ".weight_scale_inv"] = q, scale
        plain[key + ".weight"] = dequantize_blockwise(q, scale, BLOCK, torch.bfloat16)

    with torch.no_grad():
        for pname, p in model.state_dict().items():
            base = pname.rsplit(".", 1)[0]
            if pname.endswith("experts.gate_up_proj"):  # [experts, 2 x width, hidden]
                half = p.shape[1] // 2
                for e in range(p.shape[0]):
                    put(f"{base}.{e}.gate_proj", p[e, :half])
                    put(f"{base}.{e}.up_proj", p[e, half:])
            elif pname.endswith("experts.down_proj"):
                for e in range(p.shape[0]):
                    put(f"{base}.{e}.down_proj", p[e])
            elif _quantized(pname, p):
                put(base, p)
            elif p.abs().sum() == 0 and p.dim() >= 2:  # a zero-initialised router: a real spread
                tensors[pname] = plain[pname] = torch.randn_like(p).mul_(0.5).to(torch.bfloat16)
            else:
                tensors[pname] = plain[pname] = p.to(torch.bfloat16)
    hf = config.to_dict() | {"torch_dtype": "bfloat16"}
    for path, weights, quant in ((folder, tensors, FP8_CONFIG), (twin, plain, None)):
        if path is None:
            continue
        path.mkdir(parents=True, exist_ok=True)
        save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
        (path / "config.json").write_text(json.dumps(
            hf | ({"quantization_config": quant} if quant else {})))
    return folder


def rank_main_keeping_fp8(args, requests, replies, verified=None) -> None:
    """A rank (target_group/rank.main) on the CPU that keeps the FP8 weights FP8, as on an H200:
    transformers' FP8 quantizer is told of a GPU of compute capability 9.0 while it checks its
    environment (only then: the rest of the load stays on the CPU), and the loader that the
    device keeps FP8. transformers then builds its FP8 layers, whose kernels cannot load here, as
    on a GPU node without the kernels package or network."""
    from transformers.quantizers import quantizer_finegrained_fp8 as quantizer

    from dflash_core.models.target import fp8
    from dflash_core.target_group.rank import main

    check = quantizer.FineGrainedFP8HfQuantizer.validate_environment

    def as_on_an_h200(self, *a, **kw):
        saved = torch.cuda.is_available, torch.cuda.get_device_capability
        torch.cuda.is_available = lambda: True
        torch.cuda.get_device_capability = lambda device=None: (9, 0)
        try:
            return check(self, *a, **kw)
        finally:
            torch.cuda.is_available, torch.cuda.get_device_capability = saved

    quantizer.FineGrainedFP8HfQuantizer.validate_environment = as_on_an_h200
    fp8.fp8_dequantize_reason = lambda devices, routed_experts: None
    main(args, requests, replies, verified)
