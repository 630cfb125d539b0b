"""Train a drafter from a config file (the default verb).

On the dashboard, or --headless.

examples:
  dflash-tui run --config config.yaml              the dashboard owns the run
  dflash-tui run --config config.yaml --headless   no screen; progress lines on stdout
  dflash-tui run --config config.yaml --resume     go on from the latest intact checkpoint
  dflash-tui run --config config.yaml --set optim.name=muon --set run.name=muon-1
                                                   one run with other config values
  dflash-tui --config config.yaml                  the same as `run` (no verb: run)

The run's records (events.jsonl, train.log, checkpoints/) go to run.output_dir/run.name; a
second terminal follows it with `dflash-tui attach RUN_DIR`. A terminal that hangs up leaves the
run going on headless. Exit codes (headless): 0 finished, 1 failed, 2 bad input (config, flags),
130 aborted.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path
from typing import Callable

from dflash_core.config.reference import keys_help

from ._shared import setting, steps


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", type=Path, metavar="FILE", help="run config (YAML); restart re-reads it")
    add_run_options(p)
    p.add_argument("--new-run", action="store_true",
                   help="when the run folder holds an earlier run, start in a fresh numbered one "
                        "beside it (run.name-2, -3, ...) instead of refusing")


def add_run_options(p: argparse.ArgumentParser) -> None:
    """What every verb that owns an engine takes (run, demo)."""
    p.add_argument("--headless", action="store_true", help="no screen; progress lines on stdout")
    p.add_argument("--resume", action="store_true",
                   help="resume from the latest intact checkpoint of the run folder")
    # One path for both: --max-steps N is a --set of run.max_steps, applied in command-line order.
    p.add_argument("--max-steps", type=max_steps_setting, action="append", default=[],
                   dest="overrides", metavar="N",
                   help="the same as --set run.max_steps=N (>= 0; 0 = all epochs)")
    p.add_argument("--set", type=setting, action="append", default=[], dest="overrides",
                   metavar="SECTION.KEY=VALUE",
                   help="override one config key for this command's runs, e.g. --set "
                        "optim.name=muon (repeat for several; a restart keeps them); the keys "
                        "are listed below")
    p.epilog = keys_help()


def max_steps_setting(text: str) -> tuple[str, str]:
    """--max-steps N as the --set it is: ("run.max_steps", "N"), N checked by argparse."""
    return "run.max_steps", str(steps(text))


def make_engine(args: argparse.Namespace):
    """The engine of the run: the config file read once here, its --set applied (a config
    error ends the command before any run: exit 2), and handed to the engine for its first
    start; a restart reads the file again."""
    from dflash_core.config import ConfigError, apply_overrides, load_config
    from dflash_core.pipeline.engine import Engine

    check_resume(args)
    if args.config is None:
        raise ConfigError("", "nothing to run: no --config",
                          hint="pass --config config.yaml, or try the built-in model: "
                               "dflash-tui demo")
    cfg = apply_overrides(load_config(args.config), args.overrides)
    return Engine(cfg, config_path=args.config, resume=args.resume, new_run=args.new_run,
                  overrides=args.overrides)


def check_resume(args: argparse.Namespace) -> None:
    from dflash_core.config import ConfigError

    if args.resume and getattr(args, "new_run", False):
        raise ConfigError("", "--resume and --new-run contradict each other",
                          hint="pass --resume to continue the run in its folder, or --new-run to "
                               "start a fresh one beside it")


def run(args: argparse.Namespace) -> int:
    return own(lambda: make_engine(args), headless=args.headless)


def own(make: Callable[[], object], *, headless: bool) -> int:
    """Build the engine (``make``; a ConfigError is exit 2) and run it, headless or under the
    dashboard; the exit code of the run."""
    from dflash_core.config import ConfigError

    try:
        engine = make()
    except ConfigError as exc:
        print(f"config error: {exc}\nhint: {exc.hint}" if exc.hint else f"config error: {exc}",
              file=sys.stderr)
        # Several nodes (torchrun): the others wait to join this one; tell them why it won't.
        from dflash_core.multinode.nodes import tell_failure_before_joining

        tell_failure_before_joining(f"config error: {exc}", exc.hint)
        return 2
    if headless:
        from dflash_core.pipeline.headless import run_headless

        return run_headless(engine)
    from dflash_core.pipeline.inbox import open_inbox
    from dflash_tui.app import run_app

    run_dir = engine.run_dir()
    inbox = open_inbox(engine, run_dir)  # a second terminal may attach

    def go_on_headless() -> int:
        """The terminal hung up: the run goes on in this process, with no screen."""
        from dflash_core.observe.events import Log
        from dflash_core.pipeline.headless import run_headless

        signal.signal(signal.SIGHUP, signal.SIG_IGN)
        engine.bus.publish(Log(level="warning", source="dashboard", message=(
            f"terminal hung up: training goes on headless, pid {os.getpid()}; attach with "
            f"dflash-tui attach {run_dir} --control")))
        # The inbox opened above keeps serving an attached dashboard's commands.
        return run_headless(engine, start=False, serve_inbox=False)

    try:
        return run_app(engine, run_dir=run_dir, on_hangup=go_on_headless)
    finally:
        if inbox is not None:
            inbox.close()
