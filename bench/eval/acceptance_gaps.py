"""The measures of acceptance on the demo (CPU), healthy and with each fault planted: exact tau
(a), teacher-forced tau on the target's own decoding (b), on held-out data (c), in training (d),
the data/target agreement, which findings fired, and the evaluations' share of the run's time.

    python bench/eval/acceptance_gaps.py --seeds 0 1 2 --steps 300 --every 100
    python bench/eval/acceptance_gaps.py --faults leak foreign overfit --steps 100 --every 100
    python bench/eval/acceptance_gaps.py --device cuda --seeds 0 --steps 512 --every 100   # on a GPU

The healthy demo's spread of (b) - (a) over the seeds is what eval.tau_gap_warn is set above.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from dflash_core import demo  # noqa: E402
from tests.core.pipeline.acceptance_demo import FAULTS, run_demo  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0])
    ap.add_argument("--faults", nargs="+", default=["none"], choices=FAULTS)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--every", type=int, default=100)
    ap.add_argument("--device", default="cpu", help="the demo's --device (cpu, cuda, auto)")
    args = ap.parse_args()
    target = demo.ensure_tiny_target()
    data = demo.ensure_demo_data(target)
    # |b-c| compares (b) at every position (tau_tf_target_all) with (c), as the data rule does
    print("fault    seed  step  (a)exact (b)tf-target (c)tf-heldout (d)tf-train  b-a    "
          "|b-c|  d-c   agree  eval-s  findings  (b) every position")
    gaps = []
    with tempfile.TemporaryDirectory() as tmp:
        for fault in args.faults:
            for seed in args.seeds:
                r = run_demo(Path(tmp), data, fault=fault, seed=seed, steps=args.steps,
                             every=args.every, device=args.device)
                for e in r.evals:
                    gaps.append((fault, e.tau_tf_target - e.tau))
                    agree = f"{e.agreement:.2f}" if e.agreement >= 0 else "  - "
                    print(f"{fault:8s} {seed:4d} {e.step:5d}  {e.tau:8.2f} {e.tau_tf_target:11.2f}"
                          f" {e.tau_tf_heldout:13.2f} {e.tau_tf_train:11.2f}"
                          f"  {e.tau_tf_target - e.tau:+.2f}  "
                          f"{abs(e.tau_tf_target_all - e.tau_tf_heldout):.2f}  "
                          f"{e.tau_tf_train - e.tau_tf_heldout:+.2f}  {agree}  "
                          f"{e.seconds:6.1f}  {','.join(e.findings) or '-'}  {e.tau_tf_target_all:.2f}",
                          flush=True)
                print(f"# {fault} seed {seed}: {r.steps} steps in {r.seconds:.0f} s, "
                      f"evaluations {r.eval_seconds:.1f} s ({r.eval_seconds / r.seconds:.1%})",
                      flush=True)
    for fault in args.faults:
        g = [x for f, x in gaps if f == fault]
        if g:
            print(f"# {fault}: (b) - (a) over {len(g)} evaluations: {min(g):+.2f} .. {max(g):+.2f}")


if __name__ == "__main__":
    main()
