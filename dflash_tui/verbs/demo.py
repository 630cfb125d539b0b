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
    p.epilog = demo_keys_help()  # the demo's own values, not config.yaml's defaults
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="auto (default) uses the GPUs when CUDA sees any")
    p.add_argument("--output-dir", type=str, default=None, metavar="DIR",
                   help="where the run folder goes (default runs)")
    # Kept for old scripts (`--demo --new-run`): a new demo run takes a fresh folder anyway.
    p.add_argument("--new-run", action="store_true", help=argparse.SUPPRESS)


def demo_keys_help() -> str:
    """The keys --set takes, at the demo's values; the layout's as --device and the GPUs
    make them (no CUDA query here: --help must not touch a GPU)."""
    from dflash_core.config.reference import default_text, keys_help, values_text
    from dflash_core.demo import demo_config
    from dflash_core.demo.run_config import demo_layout

    values = values_text(demo_config(device="cpu", gpus=0))
    cpu, one, two = demo_layout("cpu", 0), demo_layout("cuda", 1), demo_layout("cuda", 2)
    for key, here in cpu.items():
        on_gpus = (default_text(one[key]) if one[key] == two[key]
                   else f"{default_text(one[key])}, 2+ GPUs {default_text(two[key])}")
        if (one[key], two[key]) != (here, here):
            values[f"layout.{key}"] = f"{default_text(here)} (with GPUs: {on_gpus})"
    return keys_help(values=values, whose="at the demo's values, on the CPU")


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
