"""Two target threads and two data-parallel drafters on the CPU (the engine, tiny models): how
much of the drafters' time is work (sum over steps of the mean batch cost / sum of the maxima)
and the run's wall time, with the hs queue handing out batches in plan order (as shipped) and,
for comparison, the earliest batch present (the queue before plan order). ``--busy N`` loads the
machine with N spinning processes, as a shared CI machine is loaded; ``--lag S`` makes target 1
sleep S seconds after every other forward (a slower GPU, a longer batch: targets drift apart).

    python bench/training/queue_order.py --runs 5
    python bench/training/queue_order.py --runs 5 --busy 3
    python bench/training/queue_order.py --runs 5 --lag 0.05

Half the samples are short (many rows per token-budget batch: ~4x the drafter work of a batch of
long ones), so a step that pairs batches the plan did not put together is visibly uneven.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: common.py
from common import ROOT  # noqa: F401  (puts the project on sys.path)
from dflash_core.data import write_shards
from dflash_core.data.batching import drafter_cost
from dflash_core.models.training.replica import DrafterReplica
from dflash_core.observe.events import RunEnded
from dflash_core.pipeline import hs_queue
from dflash_core.pipeline.engine import Engine
from dflash_core.pipeline.target_stage import TargetStage
from tests.core.engine_fixtures import VOCAB, make_config, make_target, run_to_end

ANCHORS, MAX_LENGTH = 8, 64


def _spin() -> None:
    while True:
        pass


def earliest_present(init):
    """The queue as it was: no plan order and no per-target share."""
    def __init__(self, *args, order=None, **kwargs):
        init(self, *args, order=None, **kwargs)
        self._share = float("inf")
    return __init__


def one_run(root: Path, target: Path, data: Path, tag: str) -> tuple[float, float]:
    costs: dict[str, list[int]] = {}
    accumulate = DrafterReplica.accumulate

    def counted(self, batch, features, seed, **kwargs):
        costs.setdefault(threading.current_thread().name, []).append(
            drafter_cost(len(batch), int(batch.lengths.max()), MAX_LENGTH, ANCHORS))
        return accumulate(self, batch, features, seed, **kwargs)

    DrafterReplica.accumulate = counted
    try:
        cfg = make_config(root / tag, target, data, layout__targets=[0, 1],
                          layout__drafters=[0, 1], layout__hs_queue=4, data__eval_prompts=0,
                          data__token_budget=256, data__max_seqs_per_batch=16,
                          drafter__num_anchors=ANCHORS, run__max_steps=0, checkpoint__every=0)
        t = time.monotonic()
        rec = run_to_end(Engine(cfg), 600)
        wall = time.monotonic() - t
        assert rec.of(RunEnded)[0].status == "finished"
    finally:
        DrafterReplica.accumulate = accumulate
    a, b = (np.array(c) for c in costs.values())
    n = min(len(a), len(b))
    a, b = a[:n], b[:n]
    return float(((a + b) / 2).sum() / np.maximum(a, b).sum()), wall


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--busy", type=int, default=0, help="spinning processes beside the runs")
    ap.add_argument("--samples", type=int, default=512)
    ap.add_argument("--lag", type=float, default=0.0,
                    help="seconds target 1 sleeps after every other forward")
    args = ap.parse_args()
    features = TargetStage._features
    calls = [0]

    def lagging(self, batch):
        out = features(self, batch)
        if self.rank == 1:
            calls[0] += 1
            if calls[0] % 2:
                time.sleep(args.lag)
        return out

    if args.lag:
        TargetStage._features = lagging
    root = Path(tempfile.mkdtemp(prefix="queue-order-"))
    rng = np.random.default_rng(0)
    samples = []
    for i in range(args.samples):
        n = int(rng.integers(10, 16)) if i % 2 else int(rng.integers(56, 64))
        samples.append({"input_ids": rng.integers(0, VOCAB - 1, n).tolist(),
                        "loss_mask": [0, 0] + [1] * (n - 2)})
    write_shards(samples, root / "data", samples_per_shard=128)
    target = make_target(root / "target")
    spinners = [mp.Process(target=_spin, daemon=True) for _ in range(args.busy)]
    for p in spinners:
        p.start()
    shipped = hs_queue.HiddenStateQueue.__init__
    try:
        for name, init in (("earliest present", earliest_present(shipped)),
                           ("plan order (shipped)", shipped)):
            hs_queue.HiddenStateQueue.__init__ = init
            got = [one_run(root, target, root / "data", f"{name[:4]}-{k}")
                   for k in range(args.runs)]
            shares, walls = zip(*got)
            print(f"{name:<22} working share {min(shares):.3f}-{max(shares):.3f}   "
                  f"wall {min(walls):.2f}-{max(walls):.2f} s   ({args.runs} runs, "
                  f"{args.busy} busy processes, lag {args.lag} s)")
    finally:
        hs_queue.HiddenStateQueue.__init__ = shipped
        for p in spinners:
            p.kill()


if __name__ == "__main__":
    main()
