"""`dflash-tui --headless` as an operator runs it: a subprocess with its output in a pipe."""

import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from dflash_core.observe.events import Checkpoint, RunEnded
from dflash_core.observe.event_log import read_events

from ..engine_fixtures import assets, make_config, write_config  # noqa: F401 - assets: a fixture

ROOT = Path(__file__).resolve().parents[3]
ANSI = re.compile(r"\x1b\[|\x1b\]|\x1b[()][0-9A-Za-z]")


class Headless:
    """``python -m dflash_tui.cli --headless --config PATH``; stdout read line by line on a
    thread (so a wait can time out), stderr to a file."""

    def __init__(self, config: Path, *extra: str):
        self.err_path = config.with_suffix(".stderr")
        self.lines: queue.Queue = queue.Queue()
        self.out: list[str] = []
        with open(self.err_path, "w") as err:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "dflash_tui.cli", "--headless", "--config", str(config),
                 *extra],
                cwd=ROOT, stdout=subprocess.PIPE, stderr=err, text=True,
                env={**os.environ, "PYTHONUNBUFFERED": "1"})
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.put(line)
        self.lines.put(None)

    def wait_line(self, needle: str, timeout: float = 60.0) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                line = self.lines.get(timeout=max(0.01, deadline - time.monotonic()))
            except queue.Empty:
                break
            if line is None:
                break
            self.out.append(line)
            if needle in line:
                return line
        raise AssertionError(f"no line with {needle!r}; output so far:\n{''.join(self.out)}")

    def finish(self, timeout: float = 90.0) -> tuple[int, str, str]:
        try:
            rc = self.proc.wait(timeout)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
        self._reader.join(10)
        while not self.lines.empty():
            line = self.lines.get()
            if line is not None:
                self.out.append(line)
        return rc, "".join(self.out), self.err_path.read_text()


def no_ansi(text: str) -> bool:
    return ANSI.search(text) is None


def test_finished_run_exits_0_with_plain_progress_lines(tmp_path, assets):
    target, data = assets
    cfg = make_config(tmp_path, target, data, run__max_steps=4, data__eval_prompts=0,
                      run__log_every_s=0.0)
    rc, out, err = Headless(write_config(tmp_path / "config.yaml", cfg)).finish()
    assert rc == 0, out + err
    assert no_ansi(out) and no_ansi(err)
    for step in (1, 2, 3, 4):  # run.log_every_s 0: a line per step
        assert re.search(rf"^step {step} epoch 0 loss \d+\.\d+ lr ", out, re.M), out
    assert "load target-0 cpu:0 done" in out
    assert "state training -> finished" in out
    assert out.rstrip().splitlines()[-1].startswith("run finished at step 4")
    assert (cfg.run_dir / "checkpoints" / "step-4").is_dir()


def test_failing_config_exits_2_with_the_error_and_its_hint(tmp_path, assets):
    # Exit 2, as for every config error (it was 1 for --config runs): the file is read before
    # any run starts, and the console shows the message and the hint, no traceback.
    target, data = assets
    path = write_config(tmp_path / "config.yaml", make_config(tmp_path, target, data))
    path.write_text(path.read_text().replace("token_budget:", "token_budgte:"))
    rc, out, err = Headless(path).finish()
    assert rc == 2, out + err
    assert no_ansi(out) and no_ansi(err)
    assert err.startswith("config error: data.token_budgte: unknown key"), err
    assert "Did you mean 'token_budget'" in err
    assert "hint: remove or rename 'data.token_budgte' in config.yaml" in err
    assert "Traceback" not in out + err and len((out + err).strip().splitlines()) == 2
    assert not cfg_run_dir(tmp_path).exists()  # no run started


def cfg_run_dir(tmp_path):
    return tmp_path / "runs" / "t"


@pytest.mark.slow  # fast paths: tests/core/persist/test_run_folder.py; test_failing_config_exits_2...
def test_a_run_folder_that_holds_a_run_is_refused_with_exit_2_and_no_traceback(tmp_path, assets):
    target, data = assets
    cfg = make_config(tmp_path, target, data, run__max_steps=1, data__eval_prompts=0)
    path = write_config(tmp_path / "config.yaml", cfg)
    rc, out, err = Headless(path).finish()
    assert rc == 0, out + err
    log_before = (cfg.run_dir / "train.log").read_text()
    rc, out, err = Headless(path).finish()  # the same config again, without --resume
    assert rc == 2, out + err
    assert "ERROR [config] engine (preflight) fatal: ConfigError: run.name: the run folder" in out, out
    assert "hint: pass --resume to continue that run" in out
    assert "Traceback" not in out + err
    assert out.count("the run folder") == 1  # the state and end lines point at it, not repeat it
    assert "run failed at step 0" in out and "see the error above" in out
    assert (cfg.run_dir / "train.log").read_text() == log_before  # not appended to


@pytest.mark.parametrize("sig", [pytest.param(signal.SIGINT, marks=pytest.mark.slow),
                                 signal.SIGTERM], ids=["SIGINT", "SIGTERM"])  # SIGTERM: fast
def test_signal_during_training_aborts_with_a_checkpoint_and_exits_130(tmp_path, assets, sig):
    target, data = assets
    cfg = make_config(tmp_path, target, data, run__max_steps=0, optim__epochs=200,
                      data__eval_prompts=0, checkpoint__every=0)
    run = Headless(write_config(tmp_path / "config.yaml", cfg))
    run.wait_line("state warmup -> training")
    run.proc.send_signal(sig)
    rc, out, err = run.finish(30)
    assert rc == 130, out + err
    assert no_ansi(out)
    assert f"signal {sig.name}: aborting" in out
    assert "state training -> aborted" in out
    assert re.search(r"^checkpoint step \d+ \(abort\)", out, re.M), out

    events = read_events(cfg.run_dir / "events.jsonl")
    (saved,) = [e for e in events if isinstance(e, Checkpoint)]
    assert saved.reason == "abort" and saved.step >= 1
    assert Path(saved.path).is_dir() and Path(saved.path).name == f"step-{saved.step}"
    assert isinstance(events[-1], RunEnded) and events[-1].status == "aborted"


def test_headless_path_does_not_import_textual(tmp_path):
    from dflash_core.config import save_config
    from dflash_core.demo import demo_config

    path = tmp_path / "c.yaml"  # the engine is made from the config read here (once)
    save_config(demo_config(output_dir=str(tmp_path)), path)
    script = (
        "import sys\n"
        "import dflash_core.pipeline.headless\n"
        "from dflash_tui.cli import parse_args\n"
        "from dflash_tui.verbs.run import make_engine\n"
        f"args = parse_args(['--headless', '--config', {str(path)!r}])\n"
        "make_engine(args)\n"
        "bad = sorted(m for m in sys.modules if m == 'textual' or m.startswith('textual.'))\n"
        "assert not bad, bad\n"
        "assert 'dflash_tui.app' not in sys.modules\n"
        "print('ok')\n"
    )
    res = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stdout + res.stderr


def test_a_restart_keeps_the_headless_process_running_into_the_next_run(tmp_path, assets,
                                                                       monkeypatch):
    # A restart from an attached dashboard ends the run; the process must go on with the next
    # one even when the new run starts after the old one has fully ended (here: 1 s later).
    import io

    from dflash_core.pipeline.engine import Engine
    from dflash_core.observe.events import RunStarted, StepMetrics
    from dflash_core.pipeline.headless import run_headless

    original_start = Engine.start

    def late_start(self):
        if threading.current_thread().name == "engine-restart":
            time.sleep(1.0)
        original_start(self)

    monkeypatch.setattr(Engine, "start", late_start)
    target, data = assets
    cfg = make_config(tmp_path, target, data, run__max_steps=0, optim__epochs=200,
                      data__eval_prompts=0, checkpoint__every=0)
    engine = Engine(cfg)
    runs: list[int] = []

    def steer(ev):
        if isinstance(ev, RunStarted):
            runs.append(0)
        elif isinstance(ev, StepMetrics):
            runs[-1] += 1
            if len(runs) == 1 and runs[-1] == 1:
                engine.restart()
            elif len(runs) == 2 and runs[-1] == 2:
                engine.abort()
    engine.bus.tap(steer)
    out = io.StringIO()
    assert run_headless(engine, out=out, every_s=0) == 130  # the second run's abort
    assert len(runs) == 2 and runs[1] >= 2, (runs, out.getvalue())
    events = read_events(cfg.run_dir / "events.jsonl")
    assert len([e for e in events if isinstance(e, RunStarted)]) == 2


@pytest.mark.parametrize("argv,fragment", [
    (["--demo", "--resume", "--new-run"], "--resume and --new-run contradict each other"),
    (["--config", "."], "cannot read config file ."),
])
def test_contradicting_flags_and_unreadable_configs_exit_2(argv, fragment, capsys):
    from dflash_tui.cli import main

    assert main(["--headless", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("config error: ") and fragment in err and "hint: " in err


@pytest.mark.parametrize("value", ["-1", "ten"])
def test_max_steps_must_be_a_count(value, capsys):
    from dflash_tui.cli import main

    with pytest.raises(SystemExit) as info:
        main(["--headless", "--demo", "--max-steps", value])
    assert info.value.code == 2
    assert "--max-steps" in capsys.readouterr().err
