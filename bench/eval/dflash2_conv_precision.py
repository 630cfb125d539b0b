"""What the served rounding of DFlash2's convolution costs in tau: one DFlash2 folder evaluated
(`dflash-tui eval`'s decoding, exact greedy tau, lossless check) three ways on the same prompts:

- ``bf16``: the drafter in bfloat16, its convolutions in bfloat16 op by op, as vLLM serves it
  (models/dflash2/conv.py; the engine's default);
- ``bf16, conv fp32``: the drafter in bfloat16, its convolutions computed in float32 (the
  engine's earlier numerics, models/dflash2/conv.accumulate_in);
- ``fp32``: the drafter in float32 throughout.

    python bench/eval/dflash2_conv_precision.py --target TARGET --drafter FOLDER \\
        --prompts heldout=S/heldout.jsonl [--prompts ...] [--max-new-tokens 128] [--limit 0] \\
        [--device cuda] --out OUT
    # on the GPU demo: train a DFlash2 drafter, write the demo's sets, compare
    dflash-tui demo --headless --device cuda --output-dir /tmp/runs --set drafter.objective=dflash2
    python bench/eval/demo_sets.py /tmp/S --n 32
    python bench/eval/dflash2_conv_precision.py --target builtin:tiny --drafter /tmp/runs/demo \\
        --prompts heldout=/tmp/S/heldout.jsonl --prompts docstrings=/tmp/S/docstrings.jsonl \\
        --max-new-tokens 128 --device cuda --out /tmp/conv-precision

Each way writes its own results folder under OUT (OUT/bf16, OUT/bf16-conv-fp32, OUT/fp32); the
table prints tau per set and way, and the prompts whose output left the target's (near ties
apart) in each.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from dflash_core.eval.options import EvalOptions  # noqa: E402
from dflash_core.eval.runner import run_eval  # noqa: E402
from dflash_core.models.dflash2 import conv  # noqa: E402

# (name, its results folder, the drafter's dtype, the convolution's dtype: None = the model's)
WAYS = (("bf16", "bf16", "bfloat16", None),
        ("bf16, conv fp32", "bf16-conv-fp32", "bfloat16", torch.float32),
        ("fp32", "fp32", "float32", None))


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", required=True, help="a target folder, or builtin:tiny")
    ap.add_argument("--drafter", required=True, help="a DFlash2 folder or run folder")
    ap.add_argument("--prompts", action="append", required=True, metavar="NAME=FILE.jsonl")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--limit", type=int, default=0, help="the first N prompts of each set")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--out", required=True, help="a folder for the three results folders")
    return ap.parse_args(argv)


def evaluate(args, folder: str, drafter_dtype: str, conv_dtype) -> dict[str, tuple[float, int]]:
    """{set: (tau, lossless failures)} of one way."""
    opts = EvalOptions(target=args.target, drafters=[args.drafter], prompts=list(args.prompts),
                       max_new_tokens=args.max_new_tokens, limit=args.limit, batch=args.batch,
                       device=args.device, dtype="auto", drafter_dtype=drafter_dtype,
                       out=str(Path(args.out) / folder))
    with conv.accumulate_in(conv_dtype):
        rep = run_eval(opts, say=lambda line: None)
    failures = {}
    for name, _label, _m in rep.mismatches:
        failures[name] = failures.get(name, 0) + 1
    out = {}
    for s in rep.sets:
        (summary,) = s.drafters.values()
        out[s.name] = (summary.tau, failures.get(s.name, 0))
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    results = {name: evaluate(args, folder, dt, cdt) for name, folder, dt, cdt in WAYS}
    names = [w[0] for w in WAYS]
    print("| set | " + " | ".join(f"tau {n}" for n in names) + " | bf16 - bf16 conv fp32 | "
          "lossless failures (" + " / ".join(names) + ") |")
    print("|---|" + "---|" * (len(names) + 2))
    for s in results[names[0]]:
        taus = [results[n][s][0] for n in names]
        fails = " / ".join(str(results[n][s][1]) for n in names)
        print(f"| {s} | " + " | ".join(f"{t:.3f}" for t in taus)
              + f" | {taus[0] - taus[1]:+.3f} | {fails} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
