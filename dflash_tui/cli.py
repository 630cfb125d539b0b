"""`dflash-tui [--version] VERB [options]`: the command line, one verb per job.

The verbs and their order are `dflash_tui.verbs.VERBS`; each verb's module holds its arguments
and its work. With no verb the verb is `run`. The flag spellings of earlier versions
(`--demo`, `--attach DIR`, `--replay FILE`, `--config X`) are translated to verbs by `translate`,
which also refuses two modes at once (`--attach x --demo`) in one line.
"""

from __future__ import annotations

import argparse
import sys
from typing import Iterable

from dflash_tui.verbs import DEFAULT_VERB, VERBS, load

EPILOG = """\
examples:
  dflash-tui demo                         the dashboard on the built-in tiny model
  dflash-tui run --config config.yaml     the dashboard on a real run (`run` may be left out)
  dflash-tui attach runs/demo             follow a run another process owns (--control to act)
  dflash-tui VERB --help                  a verb's options and examples

The old spellings still work: --demo, --config X, --attach DIR [--read-only], --replay FILE.
"""

# The flags of the old grammar (no verb), and the verb each mode became.
LEGACY_MODES = {"--demo": "demo", "--config": "run", "--attach": "attach", "--replay": "replay"}
LEGACY_VALUES = ("--config", "--attach", "--replay", "--max-steps", "--output-dir", "--device")
OWNING = ("--headless", "--resume", "--new-run", "--max-steps", "--output-dir", "--device")
DEMO_ONLY = {"--device": "layout.device", "--output-dir": "run.output_dir"}
SPELLED = {"demo": "dflash-tui demo", "run": "dflash-tui run --config FILE",
           "attach": "dflash-tui attach RUN_DIR", "replay": "dflash-tui replay EVENTS"}


class UsageError(Exception):
    """Old-grammar flags that contradict each other; the message is the one line shown."""


def translate(argv: list[str]) -> list[str]:
    """The arguments in the verb grammar: unchanged when they start with a verb (or -h,
    --version, or an unknown word argparse will name), else the old flags as their verb.
    Raises UsageError for two modes at once or a flag its mode does not take."""
    if argv and (argv[0] in VERBS or not argv[0].startswith("-") or argv[0] in
                 ("-h", "--help", "--version")):
        return list(argv)
    seen: dict[str, str | None] = {}  # old flag -> its value (flags that take one)
    rest: list[str] = []  # what passes through to the verb
    i = 0
    while i < len(argv):
        token = argv[i]
        name, eq, inline = token.partition("=")
        if name in LEGACY_VALUES:
            value = inline if eq else (argv[i + 1] if i + 1 < len(argv) else None)
            i += 1 if eq else 2
            seen[name] = value
            if name not in LEGACY_MODES:
                rest += [name, value] if value is not None else [name]
            continue
        if token in LEGACY_MODES or token in ("--read-only", *OWNING):
            seen[token] = None
            if token not in LEGACY_MODES and token != "--read-only":
                rest.append(token)
        else:
            rest.append(token)
        i += 1
    modes = [flag for flag in seen if flag in LEGACY_MODES]
    if len(modes) > 1:
        a, b = modes[:2]
        raise UsageError(f"{a} and {b} cannot be combined: pick one "
                         f"({SPELLED[LEGACY_MODES[a]]}, or {SPELLED[LEGACY_MODES[b]]})")
    verb = LEGACY_MODES[modes[0]] if modes else DEFAULT_VERB
    if "--read-only" in seen and verb != "attach":
        raise UsageError("--read-only goes with --attach (dflash-tui attach RUN_DIR is "
                         "read-only unless --control)")
    if verb in ("attach", "replay"):
        owning = [flag for flag in seen if flag in OWNING]
        if owning:
            raise UsageError(f"{modes[0]} and {owning[0]} cannot be combined: {owning[0]} is "
                             f"for a run this process trains; {modes[0]} only shows one")
        where = seen[modes[0]]
        if where is None:
            raise UsageError(f"{modes[0]} needs a path ({SPELLED[verb]})")
        if verb == "attach":
            return ["attach", where, *rest, "--read-only" if "--read-only" in seen
                    else "--control"]  # the old --attach acted on the run unless --read-only
        return ["replay", where, *rest]
    if verb == "run":
        demo_only = [flag for flag in seen if flag in DEMO_ONLY]
        if demo_only:
            flag = demo_only[0]
            raise UsageError(f"{flag} goes with --demo (dflash-tui demo {flag} ...); with "
                             f"--config the config decides: set {DEMO_ONLY[flag]} there")
        if "--config" not in seen:
            return ["run", *rest]
        config = seen["--config"]  # None: argparse then says --config expects a path
        return ["run", "--config", *([config] if config is not None else []), *rest]
    return ["demo", *rest]


def build_parser(verbs: Iterable[str] | None = None) -> argparse.ArgumentParser:
    """Every verb as a sub-command; only ``verbs`` (None: all) get their options, so a command
    imports only what its own verb's options need."""
    p = argparse.ArgumentParser(
        prog="dflash-tui", formatter_class=argparse.RawDescriptionHelpFormatter, epilog=EPILOG,
        description="The console and engine that train DFlash drafters: one verb per job.")
    p.add_argument("--version", action="version", version=f"dflash-tui {_version()}")
    subs = p.add_subparsers(title="verbs", metavar="VERB", dest="verb", required=True)
    for name in VERBS:
        module = load(name)
        doc = (module.__doc__ or name).strip()
        sub = subs.add_parser(name, help=doc.splitlines()[0], description=doc,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
        if verbs is None or name in verbs:
            module.add_arguments(sub)
        sub.set_defaults(verb_module=module)
    return p


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("dflash-tui")
    except PackageNotFoundError:
        return "(not installed)"


def parse_args(argv: list[str]) -> argparse.Namespace:
    """Either grammar's arguments as the verb's namespace (``verb``, ``verb_module``, its
    options); exits 2 with one line on contradicting old flags, as argparse does on bad ones."""
    try:
        translated = translate(argv)
    except UsageError as exc:
        build_parser(()).exit(2, f"dflash-tui: {exc}\n")
    return build_parser(translated[:1]).parse_args(translated)


def main(argv: list[str] | None = None) -> int:
    try:
        # a verb's parser may import torch and transformers (seconds): a Ctrl+C then is as
        # clean as one later
        args = parse_args(sys.argv[1:] if argv is None else list(argv))
        return args.verb_module.run(args)
    except KeyboardInterrupt:  # Ctrl+C before a screen or a run takes it (a wait for node 0)
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
