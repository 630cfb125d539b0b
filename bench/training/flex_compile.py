"""Where the drafter's first step goes: compile time of the block mask, the FlexAttention forward
and its backward, at the drafter-step benchmark's 8B shape (a micro-batch of 2 samples, 3072
context tokens, 512 anchors x block 16, 32 query / 8 KV heads of 128), then the same calls again.
Run it twice: the second process shows what inductor's on-disk cache saves.

    python bench/training/flex_compile.py [--samples 2]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: common.py
from common import env_line
from dflash_core.models.block_attention import flex_block_attention, make_block_mask


def timed(label, fn):
    torch.cuda.synchronize()
    t = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    print(f"  {label}: {time.perf_counter() - t:.1f} s", flush=True)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--samples", type=int, default=2)
    args = ap.parse_args()
    print(env_line())
    n, S, A, B, h, hkv, d = args.samples, 3072, 512, 16, 32, 8, 128
    dev = "cuda"
    for rnd in range(2):
        torch.manual_seed(rnd)
        anchors = torch.sort(torch.randperm(S - B, device=dev)[: n * A].view(n, A) + 1, dim=1).values
        q = torch.randn(n, h, A * B, d, device=dev, dtype=torch.bfloat16, requires_grad=True)
        kc, vc = (torch.randn(n, hkv, S, d, device=dev, dtype=torch.bfloat16, requires_grad=True)
                  for _ in range(2))
        kb, vb = (torch.randn(n, hkv, A * B, d, device=dev, dtype=torch.bfloat16, requires_grad=True)
                  for _ in range(2))
        print(f"round {rnd}")
        mask = timed("block mask", lambda: make_block_mask(anchors, S, B))
        out = timed("flex forward", lambda: flex_block_attention(
            q, kc, vc, kb, vb, anchors, B, d ** -0.5, compile=True, block_mask=mask))
        timed("flex backward", lambda: out.float().square().mean().backward())


if __name__ == "__main__":
    main()
