"""Data-parallel drafters step together, so each step lasts as long as its dearest batch. This
prints, from the batch plan alone (CPU, no model), the share of drafter time spent working
(sum over steps of the mean batch cost / sum of the maxima) with the epoch's batches in shuffled
order and in the balanced order of ``data.balance_steps``.

    python bench/step_balance.py --budget 65536 --drafters 6    # config.yaml's node
    python bench/step_balance.py --budget 16384 --drafters 2    # bench/pipeline.py's two drafters

Lengths: log-normal like chat SFT data (median ~900 tokens, 256..3072), as bench/pipeline.py
makes them. Cost of a batch for the drafter: rows x min(anchors, longest row) block positions.
"""

from __future__ import annotations

import argparse

import numpy as np

from common import ROOT  # noqa: F401  (puts the project on sys.path)
from dflash_core.data.batching import drafter_cost, plan_epoch


def lockstep_share(plan, lengths, group: int, anchors: int, max_length: int) -> float:
    cost = np.array([drafter_cost(len(b), int(max(lengths[b])), max_length, anchors)
                     for b in plan], float)
    steps = cost[: len(cost) // group * group].reshape(-1, group)
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
        print(f"epoch {epoch}: {len(plain)} batches, {args.drafters} per step: drafters working "
              f"{lockstep_share(plain, lengths, args.drafters, args.anchors, args.max_length):.3f}"
              f" of the time shuffled, "
              f"{lockstep_share(bal, lengths, args.drafters, args.anchors, args.max_length):.3f}"
              " balanced")


if __name__ == "__main__":
    main()
