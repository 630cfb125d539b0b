"""`dflash-tui`: the dashboard that owns the engine, or the same engine headless.

    dflash-tui --demo                  dashboard on the built-in tiny model
    dflash-tui --config config.yaml    dashboard on a real run
    dflash-tui --headless ...          no screen (no Textual import), logs in the run folder
    dflash-tui --replay events.jsonl   replay a recorded run into the dashboard
    dflash-tui --attach runs/NAME      dashboard on a run another process owns (a headless one):
                                       a / r reach that run, q detaches and leaves it running
    dflash-tui serve runs/NAME         the attached dashboard in a browser (127.0.0.1:8000;
                                       read-only unless --control, which puts a token in the URL)
    dflash-tui check --config FILE     train-to-serve check before a long run (also --demo):
                                       memorise a few samples, decode them exactly, diagnose
    dflash-tui report runs/NAME        write runs/NAME/report.html: plots, errors, stalls, config
                                       of the run (finished or running), one self-contained file
    dflash-tui data prepare|regenerate|inspect
                                       conversations -> training shards; responses rewritten by
                                       the target through OpenAI-compatible servers; inspect data
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dflash-tui", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", type=Path, help="run config (YAML); restart re-reads it")
    p.add_argument("--demo", action="store_true",
                   help="train on the built-in tiny target and data made on the spot")
    p.add_argument("--headless", action="store_true", help="no screen; progress lines on stdout")
    p.add_argument("--resume", action="store_true",
                   help="resume from the latest intact checkpoint of the run folder")
    p.add_argument("--new-run", action="store_true",
                   help="when the run folder holds an earlier run, start in a fresh numbered one "
                        "beside it (run.name-2, -3, ...) instead of refusing")
    p.add_argument("--max-steps", type=_steps, default=None,
                   help="override run.max_steps (>= 0; 0 = all epochs)")
    p.add_argument("--output-dir", type=str, default=None, help="override run.output_dir")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="--demo only: auto (default) uses the GPUs when CUDA sees any")
    p.add_argument("--replay", type=Path, help="replay an events.jsonl into the dashboard")
    p.add_argument("--attach", type=Path, metavar="RUN_DIR",
                   help="follow a live run owned by another dflash-tui process (its run folder)")
    p.add_argument("--read-only", action="store_true",
                   help="--attach only: a view; abort and restart are refused (q, s still work)")
    return p


def _steps(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number of steps, got {text!r}")
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0 (0 = all epochs), got {value}")
    return value


def make_engine(args):
    from dflash_core.config import ConfigError
    from dflash_core.pipeline.engine import Engine

    if args.resume and args.new_run:
        raise ConfigError("", "--resume and --new-run contradict each other",
                          hint="pass --resume to continue the run in its folder, or --new-run to "
                               "start a fresh one beside it")
    if args.config is not None:
        if args.device != "auto":
            raise ConfigError("layout.device", "--device is for --demo; with --config the "
                              "config decides", hint="set layout.device in the config file")
        if args.output_dir:
            raise ConfigError("run.output_dir", "--output-dir cannot be combined with --config",
                              hint="set run.output_dir in the config file")
        return Engine(config_path=args.config, resume=args.resume, max_steps=args.max_steps,
                      new_run=args.new_run)
    if not args.demo:
        raise ConfigError("", "nothing to run", hint="pass --config config.yaml or --demo")
    from dflash_core.demo import demo_config

    cfg = demo_config(output_dir=args.output_dir or "runs", device=args.device)
    # The demo is run again and again: a new demo run takes a fresh folder (runs/demo-2, ...)
    # rather than refuse; --resume continues runs/demo.
    return Engine(cfg, resume=args.resume, max_steps=args.max_steps,
                  new_run=not args.resume)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] == "data":  # dflash-tui data prepare | regenerate | inspect
        from dflash_tui.verbs import data as data_verb

        parser = argparse.ArgumentParser(prog="dflash-tui data",
                                         description=data_verb.__doc__.splitlines()[0])
        data_verb.add_arguments(parser)
        return data_verb.run(parser.parse_args(argv[1:]))
    if argv and argv[0] == "report":  # dflash-tui report RUN_DIR [--out FILE]
        from dflash_tui.report import main as report_main

        return report_main(argv[1:])
    if argv and argv[0] == "check":  # dflash-tui check --config FILE | --demo (until the verb
        # registry lands: then this is its line in dflash_tui/verbs/__init__.py)
        from dflash_tui.verbs import check

        parser = argparse.ArgumentParser(prog="dflash-tui check",
                                         description=check.__doc__.splitlines()[0],
                                         epilog="\n".join(check.__doc__.splitlines()[2:]),
                                         formatter_class=argparse.RawDescriptionHelpFormatter)
        check.add_arguments(parser)
        return check.run(parser.parse_args(argv[1:]))
    if argv and argv[0] == "serve":  # dflash-tui serve RUN_DIR [--port P] [--host H] [--control]
        from dflash_tui.serve import main as serve_main

        return serve_main(argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.read_only and args.attach is None:
        parser.error("--read-only goes with --attach")
    if args.attach is not None:
        from dflash_tui.follow import FollowController

        follower = FollowController(args.attach)
        if not follower.events_path.exists():
            print(f"nothing to attach to: {follower.events_path} does not exist\nhint: pass the "
                  f"run folder of a running dflash-tui (run.output_dir/run.name, e.g. runs/demo)",
                  file=sys.stderr)
            return 2
        from dflash_tui.app import run_app

        return run_app(follower, run_dir=None, read_only=args.read_only)
    if args.replay is not None:
        from dflash_tui.app import run_app
        from dflash_tui.replay import ReplayController

        # No post-mortem: the replay itself shows how that run ended.
        return run_app(ReplayController.from_jsonl(args.replay), run_dir=None)
    from dflash_core.config import ConfigError

    try:
        engine = make_engine(args)
        if args.config is not None:  # a config error ends here, before any run: exit 2
            from dflash_core.config import load_config
            load_config(args.config)
    except ConfigError as exc:
        print(f"config error: {exc}\nhint: {exc.hint}" if exc.hint else f"config error: {exc}",
              file=sys.stderr)
        # Several nodes (torchrun): the others wait to join this one; tell them why it won't.
        from dflash_core.multinode.nodes import tell_failure_before_joining

        tell_failure_before_joining(f"config error: {exc}", exc.hint)
        return 2
    if args.headless:
        from dflash_core.pipeline.headless import run_headless

        return run_headless(engine)
    from dflash_core.pipeline.inbox import open_inbox
    from dflash_tui.app import run_app

    run_dir = engine.run_dir()
    inbox = open_inbox(engine, run_dir)  # a second terminal may attach with --attach

    def go_on_headless() -> int:
        """The terminal hung up: the run goes on in this process, with no screen."""
        from dflash_core.observe.events import Log
        from dflash_core.pipeline.headless import run_headless

        signal.signal(signal.SIGHUP, signal.SIG_IGN)
        engine.bus.publish(Log(level="warning", source="dashboard", message=(
            f"terminal hung up: training goes on headless, pid {os.getpid()}; attach with "
            f"dflash-tui --attach {run_dir}")))
        # The inbox opened above keeps serving an attached dashboard's commands.
        return run_headless(engine, start=False, serve_inbox=False)

    try:
        return run_app(engine, run_dir=run_dir, on_hangup=go_on_headless)
    finally:
        if inbox is not None:
            inbox.close()


if __name__ == "__main__":
    sys.exit(main())
