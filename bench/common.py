"""Shared helpers for the GPU benchmarks: random-weight models of real shapes, timing, FLOPs.

Weights are random (nothing can be downloaded); throughput and memory do not depend on values.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
FIXTURES = ROOT / "tests" / "fixtures"
H200_BF16_PEAK = 790e12  # measured dense bf16 matmul rate on this GPU (8192^3, random data)


def hf_config(name):
    """A transformers config object from a fixture JSON name, a path or a config.json dict (text
    config for multimodal ones)."""
    from transformers import AutoConfig

    d = dict(name) if isinstance(name, dict) else json.loads((FIXTURES / name).read_text())
    d = d.get("text_config", d) | {"model_type": d.get("text_config", d).get("model_type", d["model_type"])}
    if d["model_type"] == "qwen3_5":
        d["model_type"] = "qwen3_5_text"
    mt = d.pop("model_type")
    return AutoConfig.for_model(mt, **d)


def random_causal_lm(cfg, device="cuda", dtype=torch.bfloat16):
    """Build directly on the GPU in bf16 (no host copy of tens of GB)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    model.requires_grad_(False).eval()
    return model


def use_transformers_norm() -> None:
    """The drafter with transformers' eager Qwen3RMSNorm instead of its fused one (--hf-norm: the
    before/after of that change on the same code)."""
    import dflash_core.models.dflash.drafter as drafter_mod
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm
    drafter_mod.RMSNorm = Qwen3RMSNorm


def cuda_time(fn, iters: int, warmup: int = 2) -> float:
    """Mean seconds per call, after warm-up, synchronised."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / iters


def gib(n: float) -> str:
    return f"{n / 2**30:.1f} GiB"


def env_line() -> str:
    import transformers

    name = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    return (f"{name}, torch {torch.__version__}, transformers {transformers.__version__}, "
            f"{time.strftime('%Y-%m-%d')}")


def decoder_flops_per_token(cfg, layers: int) -> float:
    """Forward matmul FLOPs per token of `layers` Qwen3 decoder layers (2 * params touched),
    excluding attention scores (added separately where the sequence length is known)."""
    H, I = cfg.hidden_size, cfg.intermediate_size
    hd = getattr(cfg, "head_dim", None) or H // cfg.num_attention_heads
    q = cfg.num_attention_heads * hd
    kv = cfg.num_key_value_heads * hd
    per_layer = H * q + 2 * H * kv + q * H + 3 * H * I
    return 2.0 * per_layer * layers
