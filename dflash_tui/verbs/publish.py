"""Publish a checkpoint as a clean folder for a model hub, with its model card.

examples:
  dflash-tui publish runs/demo --out hub/demo-drafter
        the checkpoint runs/demo/checkpoints/best names (else the latest complete one)
  dflash-tui publish runs/demo/checkpoints/step-600 --out hub/demo-drafter --overwrite
        that step, replacing what an earlier publish wrote there

The folder holds config.json and model.safetensors (byte-identical copies, checked against the
checkpoint's checksums.json; an older checkpoint's config.json gets the serving keys it left
unstated) and README.md: the target, objective, block size, layer ids, the block's attention
and DSpark's slot layout, data, steps, exact tau per prompt set from the run's evaluations,
GPU-hours, and the vLLM and SGLang command lines (no SGLang one for DFlash2). A damaged checkpoint, one without served weights, and an --out that publish did
not write (a file, or a folder of other entries) are refused; nothing is overwritten.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("source", type=Path, metavar="RUN_OR_CHECKPOINT",
                   help="a run folder (runs/NAME) or a checkpoint (runs/NAME/checkpoints/step-N)")
    p.add_argument("--out", type=Path, required=True, metavar="DIR",
                   help="the folder to write (new, empty, or an earlier publish's with "
                        "--overwrite)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace a folder an earlier publish wrote (never any other)")


def run(args: argparse.Namespace) -> int:
    from dflash_core.publish.folder import PublishError, publish

    try:
        done = publish(args.source, args.out, overwrite=args.overwrite, note=print)
    except PublishError as exc:
        print(f"nothing published: {exc}" + (f"\nhint: {exc.hint}" if exc.hint else ""),
              file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"nothing published: could not write {args.out}: {exc}", file=sys.stderr)
        return 1
    f = done.facts
    taus = ", ".join(f"{t.prompt_set or 'held-out'} {t.tau:.4f}" for t in f.taus) or \
        f"no evaluation at step {f.step}"
    print(f"{'replaced' if done.replaced else 'wrote'} {done.out}: {f.title} drafter, step "
          f"{f.step}, exact tau {taus}; serve it with the lines in {done.out / 'README.md'}")
    return 0
