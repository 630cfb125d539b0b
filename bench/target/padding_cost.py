"""What right-padding costs the hybrid target's forward (issue: pack or pad?). The engine's batches
are planned by length (data/batching.py: sorted within windows, filled to a token budget), so a
batch pads each row to its longest. This times TargetModel.features on such planned batches and
on the same real tokens laid out without padding (rows of equal length), per real token.

    python bench/target/padding_cost.py [--layers 16] [--budget 65536] [--batches 12]

Qwen3.6-27B-shaped (Gated DeltaNet + full attention), random bf16 weights; ``--layers`` keeps the
first N layers of the 64 (the layer pattern repeats, so the ratio does not need all of them).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: common.py
from common import cuda_time, env_line, hf_config, random_causal_lm
from dflash_core.data.batching import padding_fraction, plan_epoch
from dflash_core.models.target.model import TargetModel


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--budget", type=int, default=65536)
    ap.add_argument("--batches", type=int, default=12)
    args = ap.parse_args()
    print(env_line())
    cfg = hf_config("qwen3_6_27b_config.json")
    cfg.num_hidden_layers = args.layers
    cfg.layer_types = cfg.layer_types[: args.layers]
    model = random_causal_lm(cfg)
    tm = TargetModel(model)
    layers = [1, args.layers // 2, args.layers - 2]
    rng = np.random.default_rng(0)
    lengths = np.clip(rng.lognormal(6.8, 0.7, 20000), 256, 3072).astype(int)
    plan = plan_epoch(lengths, token_budget=args.budget, max_seqs=64, max_length=3072, seed=0,
                      epoch=0)
    print(f"plan: {len(plan)} batches, padding {padding_fraction(plan, lengths, 3072):.2%} of "
          f"tokens (whole epoch)")
    picks = rng.choice(len(plan), size=args.batches, replace=False)
    padded_s = packed_s = real = 0.0
    for i in picks:
        rows = lengths[plan[i]]
        L, n = int(rows.max()), len(rows)
        ids = torch.randint(0, cfg.vocab_size, (n, L), device="cuda")
        mask = (torch.arange(L, device="cuda")[None] < torch.as_tensor(rows, device="cuda")[:, None])
        tokens = int(rows.sum())
        # The same real tokens without padding: equal rows of the batch's mean length.
        m = max(1, round(tokens / n))
        flat = torch.randint(0, cfg.vocab_size, (n, m), device="cuda")
        padded_s += cuda_time(lambda: tm.features(ids, mask.long(), layers), iters=2, warmup=1)
        packed_s += cuda_time(lambda: tm.features(flat, None, layers), iters=2, warmup=1)
        real += tokens
        print(f"  batch {i}: {n} x {L}, {tokens} real tokens, padding {1 - tokens / (n * L):.1%}")
    print(f"RESULT padded {real / padded_s:,.0f} real tok/s, unpadded {real / packed_s:,.0f} "
          f"tok/s: padding costs {1 - packed_s / padded_s:.1%} of the forward "
          f"({args.batches} batches, {args.layers} layers)")


if __name__ == "__main__":
    main()
