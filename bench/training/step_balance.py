"""Data-parallel drafters step together, so each step lasts as long as its dearest batch. This
prints, from the batch plan alone (CPU, no model), the share of drafter time spent working
(sum over steps of the mean batch cost / sum of the maxima) with the epoch's batches in shuffled
order and in the balanced order of ``data.balance_steps``.

    python bench/training/step_balance.py --budget 65536 --drafters 6    # config.yaml's node
    python bench/training/step_balance.py --budget 16384 --drafters 2    # bench/training/pipeline.py's two drafters

Lengths: log-normal like chat SFT data (median ~900 tokens, 256..3072), as bench/training/pipeline.py
makes them. Cost of a batch for the drafter: rows x min(anchors, longest row) block positions.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: common.py
from common import ROOT  # noqa: F401  (puts the project on sys.path)
from dflash_core.data.batching import drafter_cost, plan_epoch


# Measured microseconds per block position by row length (8B-shaped drafter, one H200).
US_PER_POSITION = ([256, 512, 1024, 2048, 3072], [245.9, 254.6, 342.4, 355.0, 369.2])


def lockstep_share(plan, lengths, group: int, anchors: int, max_length: int,
                   timed: bool = False) -> float:
    """timed: each batch's time from its block positions and the measured time per position at
    its length; else the planner's own cost (``drafter_cost``)."""
    def cost(b):
        longest = min(int(max(lengths[b])), max_length)
        if timed:
            return len(b) * min(anchors, longest) * np.interp(longest, *US_PER_POSITION)
        return drafter_cost(len(b), longest, max_length, anchors)
    c = np.array([cost(b) for b in plan], float)
    steps = c[: len(c) // group * group].reshape(-1, group)
    return float(steps.mean(1).sum() / steps.max(1).sum())


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--budget", type=int, default=65536)
    ap.add_argument("--drafters", type=int, default=6, help="x nodes x grad_accum")
    ap.add_argument("--anchors", type=int, default=512)
    ap.add_argument("--samples", type=int, default=20000)
    ap.add_argument("--max-length", type=int, default=3072)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    lengths = np.clip(rng.lognormal(6.8, 0.7, args.samples), 256, 3072).astype(int)
    kw = dict(token_budget=args.budget, max_seqs=64, max_length=args.max_length, seed=0)
    for epoch in range(3):
        plain = plan_epoch(lengths, epoch=epoch, **kw)
        bal = plan_epoch(lengths, epoch=epoch, balance=args.drafters, anchors=args.anchors, **kw)
        share = {(name, timed): lockstep_share(p, lengths, args.drafters, args.anchors,
                                               args.max_length, timed)
                 for name, p in (("shuffled", plain), ("balanced", bal)) for timed in (0, 1)}
        print(f"epoch {epoch}: {len(plain)} batches, {args.drafters} per step; drafters working, "
              f"by the planner's cost: {share['shuffled', 0]:.3f} shuffled, "
              f"{share['balanced', 0]:.3f} balanced; by measured time: "
              f"{share['shuffled', 1]:.3f} shuffled, {share['balanced', 1]:.3f} balanced")


if __name__ == "__main__":
    main()
