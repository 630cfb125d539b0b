"""How long `dflash-tui --attach` takes to show a long run: a synthetic events.jsonl of a run that
has gone on for days (8 GPUs sampled every second, queue depths, a step every 10 s, a few errors),
then the follower's time from start to its "attached" line.

    python bench/ui/attach_backlog.py --mb 300
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: common.py
from common import ROOT  # noqa: F401 - puts the project on sys.path
from dflash_core.observe import events as ev
from dflash_tui.sources.follow import FollowController


def write_run(path: Path, mb: int) -> tuple[int, float]:
    t0, t = 1.75e9, 0.0
    cfg = {"run": {"name": "long"}}
    lines = 0
    with open(path, "w", encoding="utf-8") as f:
        f.write(ev.RunStarted(run_name="long", run_dir=str(path.parent), config=cfg,
                              targets=["cuda:0", "cuda:1"], drafters=[f"cuda:{i}" for i in
                                                                      range(2, 8)],
                              ts=t0).to_json() + "\n")
        while f.tell() < mb << 20:
            t += 1.0
            for i in range(8):
                f.write(ev.GpuSample(index=i, name="H200", mem_used=80 << 30, mem_total=141 << 30,
                                     util=97.0, temperature=60.0, power=650.0,
                                     ts=t0 + t).to_json() + "\n")
            f.write(ev.QueueDepth(name=ev.HS_QUEUE, depth=7, capacity=8, ts=t0 + t).to_json() + "\n")
            lines += 9
            if int(t) % 10 == 0:
                f.write(ev.StepMetrics(step=int(t) // 10, epoch=0, loss=1.0, lr=1e-4,
                                       grad_norm=0.3, tokens_per_s=9e3, samples_per_s=8.0,
                                       tau_tf=4.0, drafter_wait_frac=0.1,
                                       target_blocked_frac=0.2, padding_frac=0.01, samples=80,
                                       total_steps=100000, ts=t0 + t).to_json() + "\n")
                lines += 1
            if int(t) % 20000 == 0:
                f.write(ev.Error(error_kind="wandb", source="sink:wandb", message="upload stalled",
                                 fatal=False, ts=t0 + t).to_json() + "\n")
                lines += 1
    return lines, t


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=int, default=300)
    args = ap.parse_args()
    folder = Path(tempfile.mkdtemp())
    lines, seconds = write_run(folder / "events.jsonl", args.mb)
    ctl = FollowController(folder)
    attached = threading.Event()
    counts: dict[str, int] = {}

    def tap(e):
        counts[e.kind] = counts.get(e.kind, 0) + 1
        if isinstance(e, ev.Log) and e.message.startswith("attached to /"):
            attached.set()
    ctl.bus.tap(tap)
    t = time.perf_counter()
    ctl.start()
    attached.wait(600)
    dt = time.perf_counter() - t
    ctl.shutdown()
    print(f"events.jsonl {args.mb} MB, {lines:,} lines, {seconds / 86400:.1f} days of run: "
          f"attached in {dt:.1f} s; events shown: {counts}")


if __name__ == "__main__":
    main()
