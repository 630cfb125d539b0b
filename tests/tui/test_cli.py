"""`dflash-tui [--version] VERB [options]`: every verb parses, the old flag spellings become
verbs, two modes at once are refused in one line (exit 2), and a path that is not a run is
refused naming the cause and the fix (exit 2, no traceback)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from dflash_tui.cli import UsageError, build_parser, main, parse_args, translate
from dflash_tui.verbs import VERBS, load

ROOT = Path(__file__).resolve().parents[2]


# --------------------------------------------------------------------------------------------
# The grammar
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("argv,verb,fields", [
    (["run", "--config", "c.yaml", "--headless", "--resume", "--max-steps", "7"], "run",
     {"config": Path("c.yaml"), "headless": True, "resume": True,
      "overrides": [("run.max_steps", "7")]}),
    (["run", "--config", "c.yaml", "--new-run"], "run", {"new_run": True, "headless": False}),
    (["demo", "--headless", "--device", "cpu", "--output-dir", "out", "--max-steps", "3"],
     "demo", {"headless": True, "device": "cpu", "output_dir": "out",
              "overrides": [("run.max_steps", "3")]}),
    # --max-steps is one spelling of --set run.max_steps: both land in one list, in order
    (["run", "--set", "run.max_steps=2", "--max-steps", "4", "--set", "optim.name=muon"], "run",
     {"overrides": [("run.max_steps", "2"), ("run.max_steps", "4"), ("optim.name", "muon")]}),
    (["demo", "--resume"], "demo", {"resume": True, "device": "auto", "overrides": []}),
    (["run", "--config", "c.yaml", "--set", "optim.name=muon", "--set", "run.name=a=b"], "run",
     {"overrides": [("optim.name", "muon"), ("run.name", "a=b")]}),
    (["demo", "--set", "optim.lr= 0.001"], "demo", {"overrides": [("optim.lr", " 0.001")]}),
    (["check", "--demo", "--set", "drafter.loss=dpace"], "check",
     {"overrides": [("drafter.loss", "dpace")]}),
    (["attach", "runs/x"], "attach", {"run_dir": Path("runs/x"), "control": False}),
    (["attach", "runs/x", "--control"], "attach", {"control": True}),
    (["attach", "runs/x", "--read-only"], "attach", {"control": False, "read_only": True}),
    (["replay", "runs/x/events.jsonl"], "replay", {"events": Path("runs/x/events.jsonl")}),
    (["serve", "runs/x", "--port", "9001", "--host", "0.0.0.0", "--control"], "serve",
     {"run_dir": Path("runs/x"), "port": 9001, "host": "0.0.0.0", "control": True}),
    (["serve", "runs/x"], "serve", {"port": 8000, "host": "127.0.0.1", "control": False}),
    (["report", "runs/x", "--out", "r.html"], "report",
     {"run_dir": Path("runs/x"), "out": Path("r.html")}),
])
def test_every_verb_parses_its_options(argv, verb, fields):
    args = parse_args(argv)
    assert args.verb == verb and args.verb_module is load(verb)
    for name, value in fields.items():
        assert getattr(args, name) == value, name


def test_a_verb_is_one_registry_line():
    # The parser is made from the registry alone: every verb listed is a sub-command, in order.
    parser = build_parser()
    (verbs,) = [a for a in parser._actions if isinstance(a, type(parser._subparsers._actions[-1]))
                and a.dest == "verb"]
    assert list(verbs.choices) == list(VERBS)
    for name in VERBS:
        module = load(name)
        assert callable(module.add_arguments) and callable(module.run)
        assert module.__doc__.strip().splitlines()[0]  # its one-line help


def test_help_lists_every_verb_with_its_one_line_help(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    flat = " ".join(out.split())  # a long help line wraps
    for name in VERBS:
        first = load(name).__doc__.strip().splitlines()[0]
        assert f" {name} {' '.join(first.split())}" in flat, name
    assert "old spellings still work" in out


@pytest.mark.parametrize("verb", list(VERBS))
def test_each_verb_has_its_own_help_with_examples(verb, capsys):
    with pytest.raises(SystemExit) as exc:
        main([verb, "--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: dflash-tui {verb}")
    assert f"  dflash-tui {verb}" in out  # an example line, beside the usage


@pytest.mark.parametrize("verb", ["run", "demo"])
def test_the_help_of_set_lists_every_config_key_with_its_default_and_range(verb, capsys):
    from dflash_core.config import config_keys

    with pytest.raises(SystemExit):
        main([verb, "--help"])
    out = capsys.readouterr().out
    assert "(--set SECTION.KEY=VALUE; docs/config.md says" in out
    for spec in config_keys():
        assert f"  {spec.path}=" in out, spec.path
    assert max(len(line) for line in out.splitlines()) <= 100
    if verb == "run":
        assert "config keys (--set SECTION.KEY=VALUE" in out
        assert "  optim.lr=0.0006  [in (0, 1]]  AdamW's peak learning rate" in out


def test_the_demo_help_shows_the_demos_own_values_not_config_yamls(capsys):
    """What `dflash-tui demo` runs with, not the schema's defaults (run.name=dflash,
    target.dtype=bfloat16, optim.lr=0.0006 are config.yaml's)."""
    with pytest.raises(SystemExit):
        main(["demo", "--help"])
    out = capsys.readouterr().out
    assert "config keys at the demo's values, on the CPU (--set" in out
    for line in ("  run.name=demo  ", "  run.output_dir=runs  ", "  run.max_steps=0  ",
                 "  run.log_every_s=2.0  ", "  target.path=builtin:tiny  ",
                 "  target.dtype=float32  ", "  drafter.objective=dflash  ",
                 "  drafter.num_layers=2  ", "  optim.lr=0.006  ", "  optim.epochs=8  ",
                 "  checkpoint.every=200  ", "  layout.device=cpu (with GPUs: cuda)  ",
                 "  layout.targets=[0]  ", "  layout.drafters=[0] (with GPUs: [0], 2+ GPUs [1])  "):
        assert line in out, line
    assert "run.name=dflash" not in out and "optim.lr=0.0006" not in out


@pytest.mark.parametrize("verb", ["attach", "serve"])
def test_both_views_say_the_same_rule_in_their_help(verb, capsys):
    with pytest.raises(SystemExit):
        main([verb, "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "The rule for every view (attach, serve): it watches and never acts on the run " \
           "unless --control is given" in out


def test_an_unknown_verb_is_named_with_the_choices(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["trian"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "invalid choice: 'trian'" in err and "demo" in err


# --------------------------------------------------------------------------------------------
# The old spellings
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("old,new", [
    ([], ["run"]),
    (["--demo"], ["demo"]),
    (["--demo", "--headless"], ["demo", "--headless"]),
    (["--demo", "--headless", "--output-dir", "runs", "--max-steps", "20"],
     ["demo", "--headless", "--output-dir", "runs", "--max-steps", "20"]),
    (["--headless", "--demo", "--device=cpu", "--resume"],
     ["demo", "--headless", "--device", "cpu", "--resume"]),
    (["--config", "c.yaml"], ["run", "--config", "c.yaml"]),
    (["--headless", "--config", "c.yaml", "--resume"],
     ["run", "--config", "c.yaml", "--headless", "--resume"]),
    (["--config=c.yaml", "--new-run"], ["run", "--config", "c.yaml", "--new-run"]),
    (["--headless"], ["run", "--headless"]),
    (["--attach", "runs/x"], ["attach", "runs/x", "--control"]),  # it always acted on the run
    (["--attach", "runs/x", "--read-only"], ["attach", "runs/x", "--read-only"]),
    (["--read-only", "--attach=runs/x"], ["attach", "runs/x", "--read-only"]),
    (["--replay", "e.jsonl"], ["replay", "e.jsonl"]),
    (["serve", "runs/x", "--control"], ["serve", "runs/x", "--control"]),  # verbs: unchanged
    (["report", "runs/x"], ["report", "runs/x"]),
    (["--help"], ["--help"]),
])
def test_old_spellings_translate_to_verbs(old, new):
    assert translate(old) == new
    if new != ["--help"]:
        parse_args(old)  # and the verb takes what it was given


@pytest.mark.parametrize("argv,message", [
    (["--attach", "x", "--demo"], "--attach and --demo cannot be combined"),
    (["--demo", "--attach", "x"], "--demo and --attach cannot be combined"),
    (["--attach", "x", "--replay", "y"], "--attach and --replay cannot be combined"),
    (["--config", "c.yaml", "--demo"], "--config and --demo cannot be combined"),
    (["--replay", "y", "--config", "c.yaml"], "--replay and --config cannot be combined"),
    (["--replay", "y", "--headless"], "--replay and --headless cannot be combined"),
    (["--attach", "x", "--resume"], "--attach and --resume cannot be combined"),
    (["--attach", "x", "--max-steps", "3"], "--attach and --max-steps cannot be combined"),
    (["--demo", "--read-only"], "--read-only goes with --attach"),
    (["--config", "c.yaml", "--device", "cuda"], "--device goes with --demo"),
    (["--config", "c.yaml", "--output-dir", "o"], "set run.output_dir there"),
    (["--attach"], "--attach needs a path"),
])
def test_two_modes_at_once_are_refused_in_one_line_with_exit_2(argv, message, capsys):
    with pytest.raises(UsageError):
        translate(argv)
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("dflash-tui: ") and message in err, err


def test_serve_runs_each_browser_through_the_attach_verb(tmp_path):
    from dflash_tui.browser.server import attach_command

    for read_only, flag in ((True, "--read-only"), (False, "--control")):
        argv = attach_command(tmp_path, read_only).split()
        # exec: the shell becomes the dashboard, which serve's signals then reach directly
        assert argv[0] == "exec" and argv[2:5] == ["-m", "dflash_tui.cli", "attach"]
        assert argv[-1] == flag
        args = parse_args(argv[4:])
        assert args.verb == "attach" and args.control is not read_only


# --------------------------------------------------------------------------------------------
# Paths that are not runs
# --------------------------------------------------------------------------------------------

def a_run(folder: Path) -> Path:
    """A folder with a one-event events.jsonl, as a run leaves it."""
    folder.mkdir(parents=True)
    (folder / "events.jsonl").write_text(json.dumps(
        {"event": "Log", "ts": 1.0, "level": "info", "source": "engine", "message": "hi"}) + "\n")
    return folder


def not_a_run_cases(tmp: Path) -> dict[str, tuple[Path, str, str]]:
    """name -> (path, what the error says, what the hint says)."""
    a_file = tmp / "notes.txt"
    a_file.write_text("not events\n")
    empty = tmp / "empty"
    empty.mkdir()
    runs = tmp / "runs"
    a_run(runs / "demo")
    nodes = tmp / "mn"
    a_run(nodes / "node-0")
    a_run(nodes / "node-1")
    return {
        "missing": (tmp / "nope", "nope", "the run folder"),
        "empty folder": (empty, "events.jsonl does not exist", "pass the run folder"),
        "folder of runs": (runs, "holds runs, it is not one", f"pass one of them: {runs / 'demo'}"),
        "several nodes": (nodes, "a run of several nodes", f"{nodes / 'node-0'}"),
        "a file": (a_file, "is a file, not a run folder", "the folder that holds events.jsonl"),
    }


ACTIONS = {"attach": "attach to", "serve": "serve", "report": "report", "replay": "replay"}


# report and replay also read an events file itself (a file is no error there: see below)
@pytest.mark.parametrize("verb,case", [
    (verb, case) for verb in ACTIONS
    for case in ("missing", "empty folder", "folder of runs", "several nodes", "a file")
    if not (case == "a file" and verb in ("report", "replay"))])
def test_a_path_that_is_not_a_run_is_refused_with_the_cause_and_the_fix(verb, case, tmp_path,
                                                                         capsys):
    path, cause, fix = not_a_run_cases(tmp_path)[case]
    action = ACTIONS[verb]
    assert main([verb, str(path)]) == 2
    err = capsys.readouterr().err
    first, hint = err.rstrip("\n").split("\n")
    assert first.startswith(f"nothing to {action}: ") and cause in first, err
    assert hint.startswith("hint: ") and fix in hint, err


def test_replay_of_a_missing_file_or_a_folder_says_so_without_a_traceback(tmp_path):
    # As an operator types it: a subprocess, whose whole stderr is the two lines.
    a_run(tmp_path / "runs" / "demo")
    for argv, cause in ((["--replay", "nonexistent.jsonl"], "nonexistent.jsonl does not exist"),
                        (["replay", "runs"], "holds runs, it is not one")):
        done = subprocess.run([sys.executable, "-m", "dflash_tui.cli", *argv], cwd=tmp_path,
                              capture_output=True, text=True, timeout=60,
                              env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
        assert done.returncode == 2, done.stderr
        assert "Traceback" not in done.stderr and cause in done.stderr, done.stderr
        assert len(done.stderr.splitlines()) == 2, done.stderr


@pytest.mark.parametrize("content,cause", [
    ("no events here\n", "holds no events of a run"),
    (b"\xff\xfe\x00binary", "cannot read"),
])
def test_replay_of_a_file_that_holds_no_events_is_refused(content, cause, tmp_path, capsys):
    path = tmp_path / "events.jsonl"
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    assert main(["replay", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("nothing to replay: ") and cause in err and "hint: " in err


def test_replay_takes_a_run_folder(tmp_path, monkeypatch):
    # The folder's events.jsonl is what reaches the dashboard.
    shown = {}

    def fake_run_app(controller, run_dir):
        shown["events"] = [e.message for e in controller.events]
        return 0

    monkeypatch.setattr("dflash_tui.app.run_app", fake_run_app)
    assert main(["replay", str(a_run(tmp_path / "demo"))]) == 0
    assert shown["events"] == ["hi"]


@pytest.mark.parametrize("argv,control", [(["attach", "RUN"], False),
                                          (["attach", "RUN", "--control"], True),
                                          (["--attach", "RUN"], True),
                                          (["--attach", "RUN", "--read-only"], False)])
def test_attach_follows_the_folder_and_acts_only_with_control(argv, control, tmp_path,
                                                               monkeypatch):
    run = a_run(tmp_path / "demo")
    got = {}

    def fake_run_app(controller, run_dir, read_only, lifeline=None):
        assert lifeline is None  # a terminal's dashboard: only serve's views get a lifeline
        got.update(folder=controller.run_dir, read_only=read_only)
        return 0

    monkeypatch.setattr("dflash_tui.app.run_app", fake_run_app)
    assert main([str(run) if a == "RUN" else a for a in argv]) == 0
    assert got == {"folder": run, "read_only": not control}


def test_a_set_that_is_not_key_equals_value_or_names_no_key_is_one_line_and_exit_2(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["run", "--config", "config.yaml", "--set", "optim.name"])
    assert exc.value.code == 2
    assert "expected SECTION.KEY=VALUE" in capsys.readouterr().err
    code = main(["demo", "--headless", "--set", "optim.nmae=muon"])
    out, err = capsys.readouterr()
    assert code == 2 and "Traceback" not in out + err
    assert "optim.nmae: --set names no config key (did you mean optim.name?)" in err
    assert "hint: --set SECTION.KEY=VALUE" in err
    assert main(["check", "--demo", "--set", "drafter.los=dpace"]) == 2
    assert "did you mean drafter.loss?" in capsys.readouterr().err


def test_the_engine_applies_the_sets_at_every_start(tmp_path):
    from dflash_core.config import save_config
    from dflash_core.demo import demo_config
    from dflash_core.pipeline.engine import Engine

    path = tmp_path / "c.yaml"
    save_config(demo_config(output_dir=str(tmp_path)), path)
    engine = Engine(config_path=path, overrides=[("optim.name", "muon"), ("drafter.loss", "dpace")])
    for _ in range(2):  # a restart reads config.yaml again: the sets stay
        cfg = engine._read_config()
        assert (cfg.optim.name, cfg.drafter.loss) == ("muon", "dpace")
    path.write_text(path.read_text().replace("lr: 0.006", "lr: 0.003"))
    assert engine._read_config().optim.lr == 0.003  # the file's edits still count


def test_a_start_reads_the_config_file_once_with_its_sets_and_a_restart_again(tmp_path,
                                                                              monkeypatch):
    from dflash_core.config import save_config
    from dflash_core.demo import demo_config
    from dflash_tui.verbs.run import make_engine

    path = tmp_path / "c.yaml"
    save_config(demo_config(output_dir=str(tmp_path)), path)
    reads = []
    real = Path.read_text

    def read_text(self, *a, **kw):
        reads.extend([self] if self == path else [])
        return real(self, *a, **kw)
    monkeypatch.setattr(Path, "read_text", read_text)
    args = parse_args(["run", "--config", str(path), "--max-steps", "3", "--set",
                       "optim.name=muon"])
    engine = make_engine(args)  # the command line's check (exit 2 on a bad value) is the read
    assert engine.run_dir() == tmp_path / "demo" and len(reads) == 1
    cfg = engine._read_config()  # the first start takes the config read for it
    assert (cfg.run.max_steps, cfg.optim.name) == (3, "muon") and len(reads) == 1
    again = engine._read_config()  # a restart reads the file again, with the same sets
    assert len(reads) == 2 and (again.run.max_steps, again.optim.name) == (3, "muon")
    assert again is not cfg


def test_ctrl_c_while_a_verbs_parser_imports_is_interrupted_not_a_traceback(monkeypatch,
                                                                            capsys):
    """eval's and check's parsers import torch and transformers (seconds): a Ctrl+C then."""
    import dflash_tui.cli as cli

    def interrupted(argv):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "parse_args", interrupted)
    assert cli.main(["eval", "--target", "x"]) == 130
    err = capsys.readouterr().err
    assert err.strip() == "interrupted" and "Traceback" not in err
