"""The dashboard: subscribes to the controller's bus, never touches engine internals.

Engine threads -> `bus.tap` -> EventBuffer (an append, never a wait) -> a timer drains it ~8 times
a second into one EngineEvents message -> DashboardState folds the batch and says which panels
changed -> only those redraw. Commands go back through the Controller, on worker threads, so a
slow abort or shutdown never freezes the screen.
"""

from __future__ import annotations

import asyncio
import os
import shlex
import signal
import time
from pathlib import Path
from typing import Callable

from textual import work
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal
from textual.screen import ModalScreen
from textual.widgets import DataTable, Footer

from dflash_core.observe import events as ev
from dflash_core.pipeline.control import Controller, dispatch
from dflash_core.pipeline.exit_codes import exit_code
from dflash_core.observe.errors import error_from_exception

from .commands import DashboardCommands
from .messages import EngineEvents, EventBuffer, TerminalLost
from .screens import ConfirmScreen, HelpScreen
from .sources import postmortem
from .state.dashboard import DashboardState
from .terminal import guarded_driver
from .widgets.errors import ErrorsPanel
from .widgets.log import LogPanel
from .widgets.registry import HEADER, ROWS, SAMPLED_PANELS, changed_panels

REFRESH_HZ = 5
# Panels fed by high-rate samples (SAMPLED_PANELS) redraw at most once per period; errors, log and
# the header's state change at once. On a small machine drawing competes with training for CPU and
# the GIL.
SAMPLED_PERIOD_S = 0.8  # + one drain tick (0.2 s): samples reach the screen within 1 s
QUIET_STATES = ("idle",) + ev.TERMINAL_STATES  # quitting in these needs no confirmation
# A read-only view says how to get one that acts: the command for a terminal (attach), the flag
# for a browser (serve starts each tab's attach; its user types no command).
READ_ONLY_SERVED = "read-only view: start serve with --control to allow abort/restart"


def read_only_message(run_dir: Path | str | None, served: bool = False) -> str:
    """What a read-only view answers to a or r: the command that allows them."""
    if served:
        return READ_ONLY_SERVED
    run = shlex.quote(str(run_dir)) if run_dir is not None else "RUN_DIR"
    return f"read-only view: dflash-tui attach {run} --control allows abort/restart"


LOGGED_COMMANDS = ("abort", "restart")  # what changes the run: in its records when asked here
ACTIONS = ("restart", "abort", "quit", "focus_errors", "focus_log", "help", "stacks")


class DFlashApp(App[None]):
    CSS_PATH = Path(__file__).with_name("dflash.tcss")  # absolute: subclasses live elsewhere
    TITLE = "dflash"
    # Below 120 columns or 40 rows the layout tightens (see dflash.tcss).
    HORIZONTAL_BREAKPOINTS = [(0, "-narrow"), (120, "-wide")]
    VERTICAL_BREAKPOINTS = [(0, "-short"), (40, "-tall")]
    COMMANDS = App.COMMANDS | {DashboardCommands}
    AUTO_FOCUS = None  # no panel lit up at start; e / l / tab move focus when wanted
    BINDINGS = [
        Binding("r", "restart", "Restart"),
        Binding("a", "abort", "Abort"),
        Binding("q", "quit", "Quit"),
        Binding("e", "focus_errors", "Errors"),
        Binding("s", "stacks", "Stacks", show=False),  # in the help, not the footer
        Binding("l", "focus_log", "Log"),
        Binding("question_mark", "help", "Help", key_display="?"),
    ]

    def __init__(self, controller: Controller, run_dir: Path | str | None = None,
                 start: bool = True, owns_run: bool = False, read_only: bool = False) -> None:
        """``owns_run``: the controller is this process's engine. Then a hang-up leaves the run
        going (the caller goes on headless) and SIGTERM / SIGINT abort it with a checkpoint.
        ``read_only``: a view (`dflash-tui serve` without --control): abort and restart are
        refused on screen and never sent."""
        super().__init__()
        self.controller = controller
        self.owns_run = owns_run
        self.read_only = read_only
        self.hung_up = False  # the terminal went away; the run was left going
        self.run_dir = Path(run_dir) if run_dir is not None else None
        self.start_run = start
        self.state = DashboardState()
        self.state.attached = controller.detach_on_quit
        self.state.read_only = read_only
        self.buffer = EventBuffer()
        self.shutdown_done = False  # run_app shuts the controller down if the app did not
        self._quitting = False
        self._dropped_seen = 0
        self._broken: set[str] = set()  # panels whose drawing failed (reported once)
        self._pending: set[str] = set()  # sampled panels changed but not yet redrawn
        self._drawn_at: dict[str, float] = {}

    def compose(self) -> ComposeResult:
        yield HEADER()
        for row_id, panels in ROWS:
            with Horizontal(id=row_id, classes="row"):
                for panel in panels:
                    yield panel()
        yield Footer()

    def notify(self, message: str, *, markup: bool = False, **kwargs) -> None:
        """A notice, shown as written: its text may name a path or a worker (literal.py)."""
        super().notify(message, markup=markup, **kwargs)

    def get_driver_class(self):
        driver = super().get_driver_class()
        try:
            from textual.drivers.linux_driver import LinuxDriver
        except ImportError:  # not a POSIX terminal
            return driver
        if issubclass(driver, LinuxDriver):
            return guarded_driver(driver, self._lost_terminal)
        return driver

    def _lost_terminal(self, exc: BaseException) -> None:
        # On Textual's writer thread: post (never waits on the loop), the loop handles it.
        self.post_message(TerminalLost(str(exc)))

    def on_terminal_lost(self, message: TerminalLost) -> None:
        if self.owns_run:
            self._hang_up()  # the run goes on headless, as on SIGHUP
        else:
            self.exit()  # a view or a replay: nothing to keep going

    def on_mount(self) -> None:
        self.theme = "ansi-dark"  # terminal's own palette: reads in 256 colours over SSH/tmux
        # Before start(), so nothing the engine publishes is missed.
        self.controller.bus.tap(self.buffer.put)
        changed = {"header"}
        if self.run_dir is not None:
            try:
                pm = postmortem.load(self.run_dir)
            except OSError as exc:
                pm = None
                self.state.add_log("warning", "post-mortem", f"cannot read {self.run_dir}: {exc}")
                changed.add("log")
            if pm is not None:
                changed |= self.state.add_postmortem(pm)
        self._show(changed)
        self.set_interval(1 / REFRESH_HZ, self._drain)
        if self.owns_run:
            loop = asyncio.get_running_loop()
            loop.add_signal_handler(signal.SIGHUP, self._hang_up)
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, self._terminate, sig)
        if self.start_run:
            self._command("start")

    def on_unmount(self) -> None:
        self.controller.bus.untap(self.buffer.put)

    # ------------------------------------------------------------------ signals (owned runs)

    def _hang_up(self) -> None:
        """The terminal is gone (a dropped SSH connection): leave the screen, not the run. From
        now on whatever the process writes to its console goes to console.log in the run folder
        (the dead terminal would refuse it, or worse, block)."""
        if self.hung_up:
            return
        self.hung_up = True
        target = (self.run_dir / "console.log") if self.run_dir is not None else Path(os.devnull)
        try:
            fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        except OSError:
            fd = os.open(os.devnull, os.O_WRONLY)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
        os.close(null)
        self.exit()

    def _terminate(self, sig: signal.Signals) -> None:
        """SIGTERM / SIGINT: abort with a checkpoint first, then exit 130, as headless does."""
        if not self._quitting:
            self._quitting = True
            self.notify(f"{sig.name}: aborting (checkpoint first)…", timeout=30)
            self._stop_engine(130)

    # ------------------------------------------------------------------ events in

    def _drain(self) -> None:
        self._flush_due()
        batch = self.buffer.drain()
        if batch:
            self.post_message(EngineEvents(batch))
        elif self.state.tick(time.time()):
            self._show({"header"})
        if self.buffer.dropped > self._dropped_seen:
            self.state.add_log("warning", "dashboard", f"the screen fell behind: "
                               f"{self.buffer.dropped - self._dropped_seen} samples not shown")
            self._dropped_seen = self.buffer.dropped
            self._show({"log"})

    def on_engine_events(self, message: EngineEvents) -> None:
        changed = changed_panels(self.state.apply_all(message.events))
        self._pending |= changed & SAMPLED_PANELS
        self._show(changed - SAMPLED_PANELS)
        self._flush_due()

    def _flush_due(self) -> None:
        now = time.monotonic()
        due = {n for n in self._pending if now - self._drawn_at.get(n, 0.0) >= SAMPLED_PERIOD_S}
        if due:
            self._pending -= due
            self._drawn_at.update(dict.fromkeys(due, now))
            self._show(due)

    def _show(self, changed: set[str]) -> None:
        reported: set[str] = set()
        for name in changed:
            try:
                self.query_one(f"#{name}").show(self.state)
            except Exception as exc:  # a drawing bug must not close the dashboard
                if name not in self._broken:  # say it once, not eight times a second
                    self._broken.add(name)
                    reported |= self.state.add_error(error_from_exception(
                        exc, error_kind="internal", source=f"dashboard:{name}", fatal=False,
                        hint=f"the {name} panel could not be drawn; the run is not affected"))
        if reported:  # each panel fails at most once, so this ends
            self._show(reported - self._broken)

    def _report(self, exc: BaseException, what: str) -> None:
        """A failed command is an error in the pane, never a closed app."""
        self._show(self.state.add_error(error_from_exception(
            exc, error_kind="internal", source="dashboard", phase=self.state.state,
            hint=f"the {what} command failed; the dashboard is still running")))

    # ------------------------------------------------------------------ commands out

    @work(thread=True, exit_on_error=False, group="control")
    def _command(self, name: str) -> None:
        try:
            if name == "start":
                self.controller.start()
            else:
                if self.owns_run and name in LOGGED_COMMANDS:
                    # In the run's records (events.jsonl, train.log), as the inbox logs one
                    # from an attached dashboard: a run that ended by hand says so.
                    self.controller.bus.publish(ev.Log(
                        level="info", source="dashboard",
                        message=f"{name} requested from the dashboard"))
                dispatch(self.controller, name)
        except Exception as exc:
            self.call_from_thread(self._report, exc, name)

    def _confirm(self, question: str, command: str) -> None:
        def answered(yes: bool | None) -> None:
            if yes:
                self.notify(f"{command} requested", timeout=3)
                self._command(command)
        self.push_screen(ConfirmScreen(question), answered)

    def _refused(self) -> bool:
        if self.read_only:
            from .browser.lifeline import served

            # The run folder a view follows: its controller's (attach passes no run_dir).
            run_dir = getattr(self.controller, "run_dir", None)
            if not isinstance(run_dir, (str, Path)):  # an engine's is a method
                run_dir = self.run_dir
            self.notify(read_only_message(run_dir, served()), severity="warning", timeout=6)
        return self.read_only

    def action_restart(self) -> None:
        if self._refused():
            return
        state = self._state_now()
        if state in ev.TERMINAL_STATES:
            step = self.state.current_step
            at = f" (step {step})" if step else ""
            self._confirm(f"The run is {state}. Restart it? config.yaml is read again and "
                          f"training resumes from the latest checkpoint{at}; a run at its last "
                          "step ends again at once unless the config allows more steps.",
                          "restart")
            return
        self._confirm("Restart the run? Workers stop, config.yaml is read again and training "
                      "resumes from the latest checkpoint.", "restart")

    def action_abort(self) -> None:
        if self._refused():
            return
        if not self._live():  # said at once, not as a question about nothing
            self.notify(f"nothing to abort: {self._no_run()}", severity="warning", timeout=4)
            return
        self._confirm("Abort the run? Every worker stops (a checkpoint is written first "
                      "when training).", "abort")

    def _state_now(self) -> str:
        try:
            return self.controller.state
        except Exception:
            return self.state.state

    def _no_run(self) -> str:
        state = self._state_now()
        return "no run has started" if state == "idle" else f"the run is {state}"

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        # While a dialog or the help is open, its own keys answer; no second dialog on top.
        if action in ACTIONS and isinstance(self.screen, ModalScreen):
            return False
        return True

    def _live(self) -> bool:
        return self._state_now() not in QUIET_STATES

    def _workers_alive(self) -> bool:
        """A live run, or an ended one whose engine still has a thread stuck past its end."""
        if self._live():
            return True
        try:
            return bool(self.controller.stuck_workers())
        except Exception:
            return True  # let the engine answer

    async def action_quit(self) -> None:
        if self._quitting:
            self.notify("still shutting down the engine…", timeout=3)
        elif self.controller.detach_on_quit:
            self._quitting = True  # attached to another process's run: leave it running
            self._stop_engine()
        elif not self._live():
            self.exit()
        else:
            def answered(yes: bool | None) -> None:
                if yes:
                    self._quitting = True
                    self.notify("shutting down: waiting for workers to stop…", timeout=30)
                    self._stop_engine()
            self.push_screen(ConfirmScreen("The run is live. Stop it and quit?"), answered)

    @work(thread=True, exit_on_error=False, group="control")
    def _stop_engine(self, code: int = 0) -> None:
        try:
            self.controller.shutdown()
        except Exception as exc:
            code = 1
            self.call_from_thread(self._report, exc, "shutdown")
        self.shutdown_done = True
        self.call_from_thread(self.exit, None, code)

    def action_stacks(self) -> None:
        if not self._workers_alive():
            self.notify(f"no worker is running: {self._no_run()}", severity="warning", timeout=4)
            return
        self.notify("stacks requested: see the log", timeout=3)
        self._command("stacks")

    def action_focus_errors(self) -> None:
        self.query_one(ErrorsPanel).query_one(DataTable).focus()

    def action_focus_log(self) -> None:
        self.query_one(LogPanel).focus()

    def action_help(self) -> None:
        if not isinstance(self.screen, HelpScreen):
            self.push_screen(HelpScreen())


def run_app(controller: Controller, run_dir: Path | str | None = None, *,
            on_hangup: Callable[[], int] | None = None, read_only: bool = False,
            lifeline=None) -> int:
    """Run the dashboard until the operator quits; returns the process exit code (0 normal).
    ``on_hangup``: the controller is this process's engine; when the terminal hangs up the
    dashboard leaves and this goes on with the run (and returns the exit code).
    ``read_only``: abort and restart are refused (see DFlashApp). ``lifeline``: an armed
    `dflash_tui.browser.lifeline.Lifeline` (a dashboard serve started), told which app to end."""
    app = DFlashApp(controller, run_dir, owns_run=on_hangup is not None, read_only=read_only)
    if lifeline is not None:
        lifeline.watch(app)
    app.run()
    if app.hung_up and on_hangup is not None:
        return on_hangup()
    code = app.return_code or 0
    if not app.shutdown_done:
        try:
            controller.shutdown()
        except Exception:
            code = code or 1
    if app.owns_run and code == 0:  # what happened to the run, as headless says it
        code = owned_exit_code(controller)
    if app.owns_run:  # the screen has gone: what became of the run stays in the scrollback
        say_how_it_ended(app, controller)
    return code


def say_how_it_ended(app: DFlashApp, controller: Controller) -> None:
    from .exit_summary import exit_summary

    try:
        state = controller.final_status or controller.state
        failure = controller.failure
    except Exception:  # a controller that cannot answer now: say what the screen last knew
        state, failure = app.state.state, None
    text = exit_summary(state, app.state.current_step, failure,
                        app.state.run_dir or app.run_dir)
    if text:
        print(text, flush=True)


def owned_exit_code(controller: Controller) -> int:
    """The exit code of a run this process owned (exit_codes.py): 0 when none was started."""
    state = controller.final_status or controller.state
    if state == "idle":
        return 0
    failure = controller.failure
    return exit_code(state, failure.error_kind if failure is not None else "")
