"""Train on the built-in tiny model: a few minutes, no download.

The tiny target and its data are made on the spot.

examples:
  dflash-tui demo                         the dashboard on it (in runs/demo, or runs/demo-2 ...)
  dflash-tui demo --headless --max-steps 50
  dflash-tui demo --set optim.name=muon    the demo with another config value
  dflash-tui demo --resume                go on with runs/demo from its latest checkpoint
  dflash-tui demo --device cpu --output-dir /tmp/runs

Each new demo run takes a fresh folder beside the last one (runs/demo-2, -3, ...); --resume
continues runs/demo. Under torchrun on several nodes node 0 picks that folder and tells the
others.
"""

from __future__ import annotations

import argparse

from .run import add_run_options, check_resume, own


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_run_options(p)
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="auto (default) uses the GPUs when CUDA sees any")
    p.add_argument("--output-dir", type=str, default=None, metavar="DIR",
                   help="where the run folder goes (default runs)")
    # Kept for old scripts (`--demo --new-run`): a new demo run takes a fresh folder anyway.
    p.add_argument("--new-run", action="store_true", help=argparse.SUPPRESS)


def make_engine(args: argparse.Namespace):
    from dflash_core.config import apply_overrides
    from dflash_core.demo import demo_config
    from dflash_core.pipeline.engine import Engine

    check_resume(args)
    # A bad --set (or --max-steps) ends here, before any run: exit 2.
    cfg = apply_overrides(demo_config(output_dir=args.output_dir or "runs", device=args.device),
                          args.overrides)
    # The demo is run again and again: a new demo run takes a fresh folder (runs/demo-2, ...)
    # rather than refuse; --resume continues runs/demo.
    return Engine(cfg, resume=args.resume, new_run=not args.resume, overrides=args.overrides)


def run(args: argparse.Namespace) -> int:
    return own(lambda: make_engine(args), headless=args.headless)
