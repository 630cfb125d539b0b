"""What a batch of a shape the machine has not met costs the hybrid target's forward: the first
and the second forward of each shape. flash-linear-attention's Gated DeltaNet kernels specialise
on a few sizes derived from the batch, each new value compiling and autotuning them: the row
count (its chunk cumsum kernel) and, in its l2norm, the bucket ceil(rows x length x heads /
65536), printed here per shape. Compiled kernels and tuned configs are cached on disk, so a second
process on the same machine does not pay again for a value it met.

    python bench/target/shape_warmup.py [--layers 4] [--rows 3,5,7] [--lengths 2] [--budget 65536]

Qwen3.6-27B-shaped by default (``--fixture`` for another target), random bf16 weights;
``--layers`` keeps the first N layers (the cost is per kernel, not per layer).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: common.py
from common import cuda_time, env_line, hf_config, random_causal_lm
from dflash_core.models.target.model import TargetModel


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
    args = ap.parse_args()
    print(env_line())
    cfg = hf_config(args.fixture)
    cfg.num_hidden_layers = args.layers
    if getattr(cfg, "layer_types", None):
        cfg.layer_types = cfg.layer_types[: args.layers]
    tm = TargetModel(random_causal_lm(cfg))
    heads = getattr(cfg, "linear_num_value_heads", 0) or cfg.num_attention_heads

    def bucket(n: int, L: int) -> str:  # the l2norm kernels' size key, for value-head rows
        return f"bucket {-(-n * L * heads // 65536)}"
    # Every layer runs: the one below the last as the feature, then the last and the final norm
    # for the post-norm hidden state (the last layer itself is no feature a default names).
    layers = [max(0, args.layers - 2)]
    print(f"layers {getattr(cfg, 'layer_types', None)}, attention {cfg._attn_implementation}")

    def first_and_second(n: int, L: int) -> tuple[float, float]:
        """Seconds of the first and the second forward of an n x L batch."""
        x = torch.randint(0, cfg.vocab_size, (n, L), device="cuda")
        def forward():
            return tm.features(x, None, layers, with_last_hidden=True)
        return tuple(cuda_time(forward, iters=1, warmup=0) for _ in range(2))
    first_and_second(1, 2048)  # the process's first forward: every kernel
    first_total = second_total = 0.0
    for n in [int(v) for v in args.rows.split(",")]:
        L = args.budget // n
        first, second = first_and_second(n, L)
        first_total += first
        second_total += second
        print(f"  {n} x {L} ({bucket(n, L)}): first forward {first:.3f} s, second "
              f"{second:.3f} s (+{first - second:.3f} s)")
    n = int(args.rows.split(",")[0])  # a row count already seen, at new lengths
    for i in range(1, args.lengths + 1):
        L = int(args.budget // n * (1 - 0.1 * i))
        first, second = first_and_second(n, L)
        print(f"  {n} x {L} (row count seen, length new, {bucket(n, L)}): first {first:.3f} s, "
              f"second {second:.3f} s")
    k = len(args.rows.split(","))
    print(f"RESULT a new row count adds {(first_total - second_total) / k:.2f} s to its first "
          f"batch (mean of {k}); the second batch of {args.layers} layers takes "
          f"{second_total / k:.3f} s")


if __name__ == "__main__":
    main()
