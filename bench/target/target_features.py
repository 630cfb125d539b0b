"""Figure 1: the engine's target worker (features of 5 layers, stops after the last one) against a
plain transformers forward of the same Qwen3-8B-shaped model, at 16K and 64K-token batches, and on
variable-length data (padding counted as waste).

    python bench/target/target_features.py [--rows fixed,varlen]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: common.py
from common import H200_BF16_PEAK, cuda_time, decoder_flops_per_token, env_line, gib, hf_config, random_causal_lm
from dflash_core.data import plan_epoch
from dflash_core.models.target.model import TargetModel
from dflash_core.models.target.config import default_layer_ids


def attn_flops(cfg, layers, n, L):
    hd = cfg.head_dim
    # causal QK^T and PV: 2 matmuls * 2 FLOPs * (L^2/2) * heads * hd per sequence
    return layers * n * 2 * 2 * (L * L / 2) * cfg.num_attention_heads * hd


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="fixed,varlen", help="fixed (3 batch shapes), varlen, or both")
    args = ap.parse_args()
    rows = set(args.rows.split(","))
    cfg = hf_config("qwen3_8b_config.json")
    model = random_causal_lm(cfg)
    tm = TargetModel(model)
    ids_layers = default_layer_ids(cfg.num_hidden_layers)
    last = max(ids_layers) + 1
    print(env_line())
    print(f"Qwen3-8B shape, layers {ids_layers}, weights {gib(torch.cuda.memory_allocated())}")
    for n, L in [(8, 2048), (32, 2048), (8, 8192)] if "fixed" in rows else []:
        x = torch.randint(0, cfg.vocab_size, (n, L), device="cuda")
        tokens = n * L
        torch.cuda.reset_peak_memory_stats()
        t_eng = cuda_time(lambda: tm.features(x, None, ids_layers), iters=5)
        peak_eng = torch.cuda.max_memory_allocated()
        torch.cuda.reset_peak_memory_stats()

        def plain():
            with torch.inference_mode():
                model.model(input_ids=x, use_cache=False)
        t_plain = cuda_time(plain, iters=5)
        peak_plain = torch.cuda.max_memory_allocated()
        fl = decoder_flops_per_token(cfg, last) * tokens + attn_flops(cfg, last, n, L)
        print(f"| {n}x{L} ({tokens // 1024}K) | engine {tokens / t_eng:,.0f} tok/s "
              f"(MFU {fl / t_eng / H200_BF16_PEAK:.2f}, peak {gib(peak_eng)}) | plain base-model "
              f"forward, all {cfg.num_hidden_layers} layers {tokens / t_plain:,.0f} tok/s "
              f"(peak {gib(peak_plain)}) | ratio {t_plain / t_eng:.2f} |")
    if "varlen" not in rows:
        return
    # Variable-length data: a length distribution like chat SFT data (log-normal, 64..3072).
    rng = np.random.default_rng(0)
    lengths = np.clip(rng.lognormal(6.8, 0.7, 4000), 64, 3072).astype(np.int64)
    plan = plan_epoch(lengths, token_budget=65536, max_seqs=64, max_length=3072, seed=0, epoch=0)
    batches = plan[:12]
    useful = sum(int(lengths[i].sum()) for b in batches for i in [b])
    padded = sum(len(b) * int(lengths[b].max()) for b in batches)
    xs = []
    for b in batches:
        L = int(lengths[b].max())
        ids = torch.randint(0, cfg.vocab_size, (len(b), L), device="cuda")
        mask = (torch.arange(L, device="cuda")[None] < torch.as_tensor(lengths[b], device="cuda")[:, None]).long()
        xs.append((ids, mask))

    def run_all():
        for ids, mask in xs:
            tm.features(ids, mask, ids_layers)
    t = cuda_time(run_all, iters=2, warmup=1)
    fl = sum(decoder_flops_per_token(cfg, last) * int(lengths[b].sum())
             + sum(attn_flops(cfg, last, 1, int(l)) for l in lengths[b]) for b in batches)
    print(f"| variable length (12 batches, budget 65536) | useful {useful / t:,.0f} tok/s, padded "
          f"{padded / t:,.0f} tok/s, padding {1 - useful / padded:.1%} | useful MFU "
          f"{fl / t / H200_BF16_PEAK:.2f} |")


if __name__ == "__main__":
    main()
