"""What a batch whose row count the process has not seen yet costs the hybrid target's forward.
Some flash-linear-attention kernels of the Gated DeltaNet layers take the batch's row count as a
compile-time constant and autotune on it, so the first batch of each new row count compiles and
benchmarks them. This times the first and the second forward of each row count, per token.

    python bench/row_count_warmup.py [--layers 4] [--rows 3,5,7,9,11] [--budget 65536]

Qwen3.6-27B-shaped (Gated DeltaNet + full attention), random bf16 weights; ``--layers`` keeps the
first N of the 64 (the cost is per kernel, not per layer, so a few layers show it).
"""

from __future__ import annotations

import argparse
import time

import torch

from common import env_line, hf_config, random_causal_lm
from dflash_core.target import TargetModel


def timed(fn) -> float:
    torch.cuda.synchronize()
    t = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--fixture", default="qwen3_6_27b_config.json",
                    help="target shape from tests/fixtures (qwen3_8b_config.json: plain attention)")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--rows", default="3,5,7,9,11", help="row counts, each new to the process")
    ap.add_argument("--budget", type=int, default=65536, help="tokens per batch (rows x length)")
    ap.add_argument("--lengths", type=int, default=1,
                    help="then this many new lengths (0.9, 0.8, ... of the first) at the first "
                         "row count")
    ap.add_argument("--align", type=int, default=1,
                    help="round every length down to a multiple of this (padding the batch's "
                         "length to a multiple would do the same)")
    args = ap.parse_args()
    print(env_line())
    cfg = hf_config(args.fixture)
    cfg.num_hidden_layers = args.layers
    if getattr(cfg, "layer_types", None):
        cfg.layer_types = cfg.layer_types[: args.layers]
    tm = TargetModel(random_causal_lm(cfg))
    layers = [args.layers - 1]
    print(f"layers {getattr(cfg, 'layer_types', None)}, attention {cfg._attn_implementation}")
    x = torch.randint(0, cfg.vocab_size, (1, 2048), device="cuda")
    timed(lambda: tm.features(x, None, layers))  # the process's first forward: every kernel
    first_total = second_total = 0.0
    for n in [int(v) for v in args.rows.split(",")]:
        L = args.budget // n // args.align * args.align
        x = torch.randint(0, cfg.vocab_size, (n, L), device="cuda")
        first = timed(lambda: tm.features(x, None, layers))
        second = timed(lambda: tm.features(x, None, layers))
        first_total += first
        second_total += second
        print(f"  {n} x {L}: first forward {first:.3f} s, second {second:.3f} s "
              f"(+{first - second:.3f} s)")
    n = int(args.rows.split(",")[0])  # a row count already seen, at new lengths
    for i in range(1, args.lengths + 1):
        L = int(args.budget // n * (1 - 0.1 * i)) // args.align * args.align
        x = torch.randint(0, cfg.vocab_size, (n, L), device="cuda")
        first = timed(lambda: tm.features(x, None, layers))
        second = timed(lambda: tm.features(x, None, layers))
        print(f"  {n} x {L} (row count seen, length new): first {first:.3f} s, second "
              f"{second:.3f} s")
    k = len(args.rows.split(","))
    print(f"RESULT a new row count adds {(first_total - second_total) / k:.2f} s to its first "
          f"batch (mean of {k}); the second batch of {args.layers} layers takes "
          f"{second_total / k:.3f} s")


if __name__ == "__main__":
    main()
