"""Run the engine with no screen: readable lines on stdout, logs in the run folder.

Exit codes (exit_codes.py, the dashboard's too): 0 finished, 1 failed, 2 failed on its input (a
bad value, bad data, a run folder that holds an earlier run, a checkpoint that does not match), 130 aborted.
SIGINT / SIGTERM abort gracefully (with a checkpoint when training). No terminal control codes, so
it behaves under nohup and in pipes. An error shows as its message and hint; its traceback goes
to the run's train.log (only an internal error, a bug, shows it on the console too).
"""

from __future__ import annotations

import signal
import sys
import threading
import time

from dflash_core.pipeline.engine import Engine
from dflash_core.pipeline.exit_codes import EXIT_ABORTED, exit_code
from dflash_core.pipeline.inbox import open_inbox
from dflash_core.observe.events import Error, Event, RunEnded, RunStarted, StateChanged
from dflash_core.observe.sinks.textlog import LineThrottle, format_event

# After SIGINT / SIGTERM before training (nothing to checkpoint yet), how long the run may take to
# end before the process leaves without its stuck threads. From warm-up on, the engine itself
# gives up on a stuck worker (supervisor.GIVE_UP_S) and skips the checkpoint it cannot trust.
ABANDON_S = 5.0
ABANDON_STATES = ("idle", "preflight", "loading")


class ConsolePrinter:
    """Prints what an operator needs, throttled like train.log: periodic lines at most once every
    ``every_s`` seconds (None: the run's ``run.log_every_s``, read from RunStarted)."""

    def __init__(self, out=None, every_s: float | None = None):
        self.out = out or sys.stdout
        self._from_config = every_s is None
        self.throttle = LineThrottle(5.0 if every_s is None else every_s)
        self._lock = threading.Lock()
        self.run_dir = ""  # from RunStarted: where train.log (with tracebacks) is
        self._failure = ""  # the last fatal error's message

    def __call__(self, ev: Event) -> None:
        if isinstance(ev, RunStarted) and self._from_config:
            self.throttle.every_s = float(ev.config.get("run", {}).get(
                "log_every_s", self.throttle.every_s))
        if not self.throttle.admit(ev):
            return
        if isinstance(ev, RunStarted):
            self.run_dir = ev.run_dir
        if isinstance(ev, Error) and ev.fatal:
            self._failure = ev.message
        elif isinstance(ev, (StateChanged, RunEnded)) and ev.reason and \
                ev.reason == self._failure:
            # The fatal error's message was just printed: once is enough on a console.
            ev = type(ev)(**{**ev.__dict__, "reason": "see the error above"})
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


def run_headless(engine: Engine, *, every_s: float | None = None, out=None, start: bool = True,
                 serve_inbox: bool = True) -> int:
    """Run (``start``) or go on with (a dashboard's terminal hung up) the engine's run until it
    ends without a restart. ``serve_inbox``: open the run folder's command inbox (False when the
    caller already serves it)."""
    printer = ConsolePrinter(out=out, every_s=every_s)
    sub = engine.bus.subscribe("console", printer)
    interrupted = threading.Event()

    interrupted_at = [0.0]

    def on_signal(signum, frame):
        if not interrupted.is_set():
            interrupted_at[0] = time.monotonic()
        interrupted.set()
        print(f"signal {signal.Signals(signum).name}: aborting (checkpoint first)", flush=True,
              file=printer.out)
        engine.abort()

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    # A dashboard attached from another terminal (dflash-tui attach RUN_DIR --control) sends its abort
    # and restart through the run folder.
    inbox = open_inbox(engine, engine.run_dir()) if serve_inbox else None
    try:
        if start:
            engine.start()
        while True:
            while engine.runs_ended < engine.runs_started:  # each started run ends in one RunEnded
                if (interrupted.is_set() and engine.state in ABANDON_STATES
                        and time.monotonic() - interrupted_at[0] > ABANDON_S):
                    # Stuck before training in a call that never returns (a read on a hung
                    # network mount): nothing to save, so the process ends without that thread
                    # rather than hang on after a stop request.
                    stuck = engine.stuck_workers()
                    print(f"the run did not end within {ABANDON_S:.0f} s of the stop request; "
                          f"exiting without {', '.join(stuck) or 'it'}", file=printer.out,
                          flush=True)
                    return EXIT_ABORTED
                time.sleep(0.2)
            engine.join(timeout=30)
            # A restart (from an attached dashboard) ends this run and starts the next one: keep
            # going. The process ends with the run that ends without one.
            while engine.restarting and not interrupted.is_set():
                time.sleep(0.1)
            if interrupted.is_set() or engine.runs_ended >= engine.runs_started:
                break
    finally:
        if inbox is not None:
            inbox.close()
        for s, h in old.items():
            signal.signal(s, h)
        engine.bus.drain(timeout=5)
        engine.bus.unsubscribe(sub)
        engine.shutdown(timeout=1 if interrupted.is_set() else 10)
    return run_exit_code(engine)


def run_exit_code(engine: Engine) -> int:
    """The exit code of the engine's last run (exit_codes.py)."""
    failure = engine.failure
    return exit_code(engine.final_status or engine.state,
                     failure.error_kind if failure is not None else "")
