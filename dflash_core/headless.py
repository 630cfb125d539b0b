"""Run the engine with no screen: readable lines on stdout, logs in the run folder.

Exit codes: 0 finished, 1 failed, 2 failed on the config (a bad value, a run folder that holds an
earlier run, a checkpoint that does not match), 130 aborted. SIGINT / SIGTERM abort gracefully
(with a checkpoint when training). No terminal control codes, so it behaves under nohup and in
pipes. An error shows as its message and hint; its traceback goes to the run's train.log (only an
internal error, a bug, shows it on the console too).
"""

from __future__ import annotations

import signal
import sys
import threading
import time

from .engine import Engine
from .inbox import open_inbox
from .events import Error, Event, RunEnded, RunStarted
from .sinks.textlog import LineThrottle, format_event

EXIT_CODES = {"finished": 0, "failed": 1, "aborted": 130}
EXIT_CONFIG = 2  # the run failed on its config, as the CLI exits on a config it cannot load


class ConsolePrinter:
    """Prints what an operator needs, throttled like train.log: periodic lines at most once every
    ``every_s`` seconds (None: the run's ``run.log_every_s``, read from RunStarted)."""

    def __init__(self, out=None, every_s: float | None = None):
        self.out = out or sys.stdout
        self._from_config = every_s is None
        self.throttle = LineThrottle(5.0 if every_s is None else every_s)
        self._lock = threading.Lock()
        self.run_dir = ""  # from RunStarted: where train.log (with tracebacks) is

    def __call__(self, ev: Event) -> None:
        if isinstance(ev, RunStarted) and self._from_config:
            self.throttle.every_s = float(ev.config.get("run", {}).get(
                "log_every_s", self.throttle.every_s))
        if not self.throttle.admit(ev):
            return
        if isinstance(ev, RunStarted):
            self.run_dir = ev.run_dir
        if isinstance(ev, Error) and ev.traceback and ev.error_kind != "internal":
            # The input's fault: message and hint; the traceback is for train.log.
            where = (f"{self.run_dir}/train.log" if self.run_dir else "")
            ev = Error(**{**ev.__dict__, "traceback": ""})
            line = format_event(ev)
            if where and ev.fatal:
                line += f"\n  (traceback in {where})"
        else:
            line = format_event(ev)
        if line is None:
            return
        with self._lock:
            print(line, file=self.out, flush=True)


def run_headless(engine: Engine, *, every_s: float | None = None, out=None) -> int:
    printer = ConsolePrinter(out=out, every_s=every_s)
    sub = engine.bus.subscribe("console", printer)
    ends = [0]  # RunEnded events seen; every start() of a run ends in exactly one
    engine.bus.tap(lambda ev: ends.__setitem__(0, ends[0] + 1) if isinstance(ev, RunEnded)
                   else None)

    interrupted = threading.Event()

    def on_signal(signum, frame):
        interrupted.set()
        print(f"signal {signal.Signals(signum).name}: aborting (checkpoint first)", flush=True,
              file=printer.out)
        engine.abort()

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    # A dashboard attached from another terminal (dflash-tui --attach RUN_DIR) sends its abort
    # and restart through the run folder.
    inbox = open_inbox(engine, engine.run_dir())
    try:
        engine.start()
        while True:
            while ends[0] < engine.runs_started:
                time.sleep(0.2)
            engine.join(timeout=30)
            # A restart (from an attached dashboard) ends this run and starts the next one: keep
            # going. The process ends with the run that ends without one.
            while engine.restarting and not interrupted.is_set():
                time.sleep(0.1)
            if interrupted.is_set() or ends[0] >= engine.runs_started:
                break
    finally:
        if inbox is not None:
            inbox.close()
        for s, h in old.items():
            signal.signal(s, h)
        engine.bus.drain(timeout=5)
        engine.bus.unsubscribe(sub)
        engine.shutdown(timeout=10)
    status = engine.final_status or engine.state
    failure = engine.failure
    if status == "failed" and failure is not None and failure.error_kind == "config":
        return EXIT_CONFIG
    return EXIT_CODES.get(status, 1)
