"""Once the dashboard that owned a run has left the screen, the terminal says how the run ended,
its folder and the command that resumes it: through the verb's own function (run.own, what
`dflash-tui run` and `demo` call), the app driven by Textual's pilot, stdout captured."""

from __future__ import annotations

import dataclasses
import shlex
from pathlib import Path

import pytest
import tui_scenarios as sc

from dflash_core.observe import events as ev
from dflash_core.persist.run_folder import resume_command
from dflash_tui.app import DFlashApp
from dflash_tui.exit_summary import exit_summary
from dflash_tui.sources.replay import ReplayController
from dflash_tui.verbs import run as run_verb



class OwnedReplay(ReplayController):
    """Stands in for the engine own() builds: a run folder, and the last fatal error."""

    def __init__(self, events, folder: Path):
        self.folder = folder
        super().__init__([dataclasses.replace(e, run_dir=str(folder))
                          if isinstance(e, ev.RunStarted) else e for e in events])

    def run_dir(self) -> Path:
        return self.folder

    def publish(self, event):
        if isinstance(event, ev.Error) and event.fatal:
            self.failure = event
        super().publish(event)


def drive(monkeypatch, keys: list[str]):
    """DFlashApp.run under the pilot (no terminal here), pressing ``keys`` then q."""
    real_run = DFlashApp.run

    async def pilot_keys(pilot):
        await pilot.pause(1.0)
        for key in keys + ["q"]:
            await pilot.press(key)
            await pilot.pause(0.3)
            await pilot.app.workers.wait_for_complete()

    def run(self, **kwargs):
        return real_run(self, headless=True, size=(160, 48), auto_pilot=pilot_keys)

    monkeypatch.setattr(DFlashApp, "run", run)


def a_run_folder(tmp_path: Path) -> Path:
    folder = tmp_path / "runs" / "demo-2"
    folder.mkdir(parents=True)
    (folder / "config.yaml").write_text("run: {name: demo-2}\n", encoding="utf-8")
    return folder


def test_an_abort_says_aborted_the_folder_and_the_resume_command(monkeypatch, tmp_path, capsys):
    folder = a_run_folder(tmp_path)
    drive(monkeypatch, ["a", "y"])
    code = run_verb.own(lambda: OwnedReplay(sc.training(steps=5), folder), headless=False)
    out = capsys.readouterr().out
    assert code == 130
    assert "dflash-tui: run aborted at step 5" in out
    assert f"  run folder: {folder}\n" in out
    assert f"  resume:     dflash-tui run --config {folder}/config.yaml --resume" in out


def test_a_failure_says_its_error_in_one_line(monkeypatch, tmp_path, capsys):
    folder = a_run_folder(tmp_path)
    drive(monkeypatch, [])
    code = run_verb.own(lambda: OwnedReplay(sc.failed(), folder), headless=False)
    out = capsys.readouterr().out
    assert code == 1
    assert ("dflash-tui: run failed at step 60: [oom] torch.OutOfMemoryError: CUDA out of "
            "memory. Tried to allocate 29.61 GiB\n") in out
    assert "Traceback" not in out  # one line, not the traceback: that is in train.log
    assert f"  resume:     {resume_command(folder)}" in out
    assert f"  details:    {folder / 'train.log'}" in out


def test_a_finished_run_says_how_to_train_on_and_a_view_says_nothing(monkeypatch, tmp_path,
                                                                    capsys):
    folder = a_run_folder(tmp_path)
    events = sc.training(steps=5) + [ev.RunEnded(status="finished", step=5, seconds=9.0)]
    drive(monkeypatch, [])
    assert run_verb.own(lambda: OwnedReplay(events, folder), headless=False) == 0
    out = capsys.readouterr().out
    assert "dflash-tui: run finished at step 5" in out
    assert "raise run.max_steps or optim.epochs in that file to train on" in out
    # Not the owner (a replay, an attached view): the run is not this process's to report.
    from dflash_tui.app import run_app

    run_app(ReplayController(events), run_dir=folder)
    assert capsys.readouterr().out == ""


def test_no_run_started_says_nothing_and_a_folder_without_config_has_no_resume(tmp_path):
    assert exit_summary("idle", None, None, tmp_path) == ""
    text = exit_summary("aborted", None, None, tmp_path)
    assert text == f"dflash-tui: run aborted\n  run folder: {tmp_path}"
    # On several nodes the records are node-K/, the config one folder up.
    (tmp_path / "config.yaml").write_text("{}\n", encoding="utf-8")
    (tmp_path / "node-1").mkdir()
    assert f"run folder: {tmp_path}\n" in exit_summary("aborted", 3, None, tmp_path / "node-1")


def test_the_resume_command_is_one_the_cli_takes():
    """The printed command parses as `run --config FILE --resume`, a path with a space too."""
    from dflash_tui.cli import build_parser

    words = shlex.split(resume_command("runs/my demo"))
    assert words[0] == "dflash-tui"
    args = build_parser(["run"]).parse_args(words[1:])
    assert args.verb == "run" and args.resume and args.config == Path("runs/my demo/config.yaml")
