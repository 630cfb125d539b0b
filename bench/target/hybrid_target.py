"""Figure 4: the launch that failed. A Qwen3.6-27B-shaped hybrid target (64 layers, Gated DeltaNet
+ full attention, vocab 248320) at token budget 65536 (8 x 8192 and 64 x 1024): the engine's target
worker runs 20+ batches without running out of memory; the report shows its peak next to what full
logits would have added.

    python bench/target/hybrid_target.py [--batches 20]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: common.py
from common import H200_BF16_PEAK, env_line, gib, hf_config, random_causal_lm
from dflash_core.models.target.model import TargetModel
from dflash_core.models.target.config import default_layer_ids


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", type=int, default=20)
    ap.add_argument("--shapes", default="8x8192,64x1024", help="batch shapes n x length")
    args = ap.parse_args()
    print(env_line())
    try:
        import fla  # noqa: F401
        print(f"flash-linear-attention {fla.__version__}")
    except ImportError:
        print("flash-linear-attention missing: transformers falls back to its torch GDN path")
    cfg = hf_config("qwen3_6_27b_config.json")
    t = time.perf_counter()
    model = random_causal_lm(cfg)
    weights = torch.cuda.memory_allocated()
    n_params = sum(p.numel() for p in model.parameters())
    print(f"built in {time.perf_counter() - t:.0f} s: {n_params / 1e9:.2f}B params, weights {gib(weights)}")
    tm = TargetModel(model)
    layers = default_layer_ids(cfg.num_hidden_layers)
    for n, L in [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]:
        x = torch.randint(0, cfg.vocab_size, (n, L), device="cuda")
        torch.cuda.reset_peak_memory_stats()
        tm.features(x, None, layers)  # warm-up (kernel compilation)
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(args.batches):
            f = tm.features(x, None, layers)
            del f
        torch.cuda.synchronize()
        dt = (time.perf_counter() - t) / args.batches
        peak = torch.cuda.max_memory_allocated()
        tokens = n * L
        flops = 2 * n_params * tokens * (max(layers) + 1) / cfg.num_hidden_layers
        logits_bf16 = tokens * cfg.vocab_size * 2
        print(f"| {n}x{L} | {args.batches} batches, no OOM | {tokens / dt:,.0f} tok/s | "
              f"~MFU {flops / dt / H200_BF16_PEAK:.2f} (matmul FLOPs only) | peak {gib(peak)} "
              f"(weights {gib(weights)}) | full logits would add {gib(logits_bf16)} bf16, "
              f"{gib(logits_bf16 * 3)} with the float32 upcast |")


if __name__ == "__main__":
    main()
