"""The in-process engine: the controller of one run at a time (the Controller protocol of
control.py: start, abort, restart, shutdown, stacks), its state across runs (lifecycle.py), and
the thread that runs each run.

Each start makes a ``Run`` (run.py: everything one run owns, made at start and dropped at the end),
its ``SetUp`` (set_up.py) and its ``Supervisor`` (supervisor.py) on a thread of its own, which
walks the run from preflight to finished, aborted or failed; an abort only sets the run's stop
flag. Workers only ever talk to the operator through events on the bus; a failure anywhere fails
the run, never the process, and the engine waits for the next command.
"""

from __future__ import annotations

import threading
from pathlib import Path

from dflash_core.config import Config, ConfigError, apply_overrides, load_config
from dflash_core.multinode.node_failure import NodeFailure
from dflash_core.multinode.node_place import node_info
from dflash_core.multinode.nodes import NodeGroup
from dflash_core.observe.bus import EventBus
from dflash_core.observe.events import TERMINAL_STATES, Error, Log
from dflash_core.observe.watchdog import format_stack, thread_stack, where
from dflash_core.persist.run_folder import fresh_name
from dflash_core.pipeline import host_memory
from dflash_core.pipeline.hs_queue import HiddenStateQueue
from dflash_core.pipeline.lifecycle import Lifecycle
from dflash_core.pipeline.run import Run
from dflash_core.pipeline.set_up import SetUp, records_dir
from dflash_core.pipeline.supervisor import GIVE_UP_S, Supervisor
from dflash_core.planning.allocator import configure_allocator


class Engine:
    """Owns one run at a time. Thread-safe control: start, abort, restart, shutdown."""

    detach_on_quit = False  # quitting the dashboard that owns the engine ends the run

    def __init__(self, config: Config | None = None, *, config_path: str | Path | None = None,
                 bus: EventBus | None = None, resume: bool = False, max_steps: int | None = None,
                 new_run: bool = False, overrides: list[tuple[str, str]] | None = None):
        if config is None and config_path is None:
            raise ValueError("Engine needs a config or a config_path")
        self.bus = bus or EventBus()
        self._owns_bus = bus is None
        host_memory.limit_arenas()  # before any run's threads: restarts must not grow RSS
        # A config file is read once per start: ``config`` is the first start's (the command
        # line loaded it, its --set applied); a restart reads ``config_path`` again.
        self.config_path = Path(config_path) if config_path else None
        self.resume = resume
        # --set KEY=VALUE pairs, applied to the config file at every (re)start; --max-steps N
        # (the old keyword here too) is one of them: run.max_steps.
        self.overrides = list(overrides or [])
        if max_steps is not None:
            self.overrides.append(("run.max_steps", str(max_steps)))
        if config is not None and self.config_path is None and self.overrides:
            config = apply_overrides(config, self.overrides)  # no file: every start runs this
        self._next_config = config  # the next start's config, once read (None: not yet)
        self._config_lock = threading.Lock()
        # Start in a fresh numbered folder when run.name's holds an earlier run (run_folder.py).
        self.new_run = new_run
        self._asked_name: str | None = None
        self._fresh_name: str | None = None
        # Set by an abort while no run is live: ends a wait for node 0's run folder name, which
        # may come before the first run starts (run_dir()).
        self._stop_waiting = threading.Event()
        self.lifecycle = Lifecycle(self.bus.publish)  # the state, kept across runs
        self._lock = threading.RLock()
        self._supervisor: threading.Thread | None = None  # the thread of the current run
        self._run: Run | None = None  # the current (or last) run
        self._restarts_pending = 0  # restart() calls whose new run has not started yet
        # Before any run touches a GPU: the allocator reads its settings at the first allocation.
        self.allocator = configure_allocator()
        self.bus.tap(self._watch_fatal)
        self.bus.tap(self._hold_early)
        # Under torchrun with several nodes: this process's node group (nodes.py), joined at the
        # first preflight and kept across runs; None on one node, where nothing changes.
        info = node_info()
        self.nodes = NodeGroup(info) if info is not None else None

    # -- control (the Controller protocol) -------------------------------------------------------
    @property
    def state(self) -> str:
        return self.lifecycle.state

    @property
    def final_status(self) -> str | None:
        """How the last run ended (a terminal state); None before any ended."""
        return self.lifecycle.final_status

    @property
    def runs_started(self) -> int:
        """start() calls that began a run (each ends in one RunEnded)."""
        return self.lifecycle.runs_started

    @property
    def runs_ended(self) -> int:
        return self.lifecycle.runs_ended

    @property
    def config(self) -> Config | None:
        """The config of the current (or last) run, once its preflight read it."""
        return self._run.config if self._run is not None else None

    @property
    def max_steps(self) -> int | None:
        """run.max_steps when the command line set it (--max-steps N, or --set run.max_steps=N:
        one spelling of the other); None while the config's own value stands."""
        cfg = self.config
        if cfg is None or all(key != "run.max_steps" for key, _ in self.overrides):
            return None
        return cfg.run.max_steps

    @property
    def step(self) -> int:
        return self._run.step if self._run is not None else 0

    @property
    def hs_queue(self) -> HiddenStateQueue | None:
        """The current run's hidden-state queue (None before loading and after the end)."""
        return self._run.hs_queue if self._run is not None else None

    @property
    def stopping(self) -> bool:
        """The current run has been asked to stop (abort, failure, or its end)."""
        return self._run is not None and self._run.stop.is_set()

    @property
    def failure(self) -> Error | None:
        """The first fatal error of the current (or last) run, if it failed."""
        return self._run.failure if self._run is not None else None

    def start(self) -> None:
        with self._lock:
            if self._supervisor is not None and self._supervisor.is_alive():
                return
            # A worker of the last run that never ended would keep going beside the new run:
            # refuse to start rather than run two pipelines at once.
            stuck = [t.name for t in self._run.threads if t.is_alive()] if self._run else []
            if stuck:
                self.bus.publish(Error(
                    error_kind="internal", source="engine", message=f"threads of the last run are "
                    f"still running: {stuck}", hint="a worker is stuck in a call that ignores the "
                    "stop flag; quit and start the process again", fatal=True, phase=self.state))
                return
            run = self._run = Run(self.bus.publish, self.lifecycle)
            set_up = SetUp(run, self.bus, nodes=self.nodes, allocator=self.allocator,
                           resume=self.resume, read_config=self._read_config,
                           renamed=self._renamed, restart=self.restart,
                           restarting=lambda: self.restarting)
            supervisor = Supervisor(run, self.bus, self.lifecycle, set_up,
                                    max_steps_from=self._max_steps_from)
            self._supervisor = threading.Thread(target=supervisor.supervise, name="engine",
                                                daemon=True)
            self.lifecycle.runs_started += 1
            self._supervisor.start()

    def abort(self) -> None:
        with self._lock:
            # The supervisor, not the state, says whether a run is live: right after start()
            # the state is still idle (or the last run's end) and the abort must not be lost.
            if self._supervisor is None or not self._supervisor.is_alive():
                self._stop_waiting.set()
                return
            self._run.abort_requested = True
            if self._run.link is not None and self._run.link.live:
                return  # every node stops together at the next step boundary (node_link.py)
            self._run.stop.set()

    def restart(self) -> None:
        """Abort, free memory, re-read the config file and resume from the latest checkpoint.
        Returns at once; the work happens on a thread."""
        def go():
            try:
                self.abort()
                # The teardown may wait up to GIVE_UP_S for workers, then save a checkpoint.
                if not self.join(timeout=GIVE_UP_S + 120):
                    self.bus.publish(Error(
                        error_kind="internal", source="engine", phase=self.state, fatal=False,
                        message="restart: the previous run has not ended after "
                        f"{GIVE_UP_S + 120:.0f} s", hint="press r again once the state shows "
                        "aborted, or quit and start the process again"))
                    return
                self.resume = True
                self.start()
            finally:
                with self._lock:
                    self._restarts_pending -= 1
        with self._lock:
            self._restarts_pending += 1
        threading.Thread(target=go, name="engine-restart", daemon=True).start()

    @property
    def restarting(self) -> bool:
        """A restart is under way: the run that ends now is followed by a new one."""
        return self._restarts_pending > 0

    def shutdown(self, timeout: float = 30.0) -> None:
        self.abort()
        self.join(timeout)
        # A run still in a collective keeps the group; it goes with the process.
        if self.nodes is not None and self.join(0):
            self.nodes.close()
        if self._owns_bus:
            self.bus.close(timeout=5.0)

    def join(self, timeout: float | None = None) -> bool:
        sup = self._supervisor
        if sup is not None:
            sup.join(timeout)
            return not sup.is_alive()
        return True

    def _live_threads(self) -> list[threading.Thread]:
        """The supervisor and the workers of the current run that are still alive."""
        threads = [self._supervisor] if self._supervisor is not None else []
        threads += self._run.threads if self._run is not None else []
        return [t for t in threads if t.is_alive()]

    def stacks(self) -> None:
        alive = self._live_threads()
        if not alive:
            self.bus.publish(Log(level="info", source="engine", message="no worker is running"))
        for t in alive:
            frames = thread_stack(t)
            self.bus.publish(Log(level="info", source=t.name, message=(
                f"stack of {t.name}: {where(frames)}\n{format_stack(frames)}")))

    def stuck_workers(self) -> list[str]:
        """Threads of the current run still alive, each with where its stack is now."""
        return [f"{t.name} ({where(thread_stack(t))})" for t in self._live_threads()]

    def run_dir(self) -> Path | None:
        """Where this process's records (events.jsonl, train.log, commands/) are, if the config
        can be read: the run folder, or its node-K/ folder on several nodes."""
        try:  # the current run's config, else the next start's (read once, kept for it)
            return self._records_dir(self.config or self._peek_config())
        except (ConfigError, OSError, NodeFailure):  # the run's preflight says why
            return None

    def _records_dir(self, cfg: Config) -> Path:
        return records_dir(cfg, self.nodes)

    def wait(self, timeout: float | None = None) -> str:
        """Block until the run reaches a terminal state (or timeout); returns the state."""
        self.join(timeout)
        return self.state

    # -- taps on the bus ----------------------------------------------------------------------
    def _watch_fatal(self, ev) -> None:
        # A critical sink (events.jsonl, train.log) that breaks ends the run: we would lose records.
        run, state = self._run, self.state
        if isinstance(ev, Error) and ev.fatal and ev.source.startswith("sink:") \
                and run is not None and state not in TERMINAL_STATES and state != "idle":
            run.note_failure(ev)  # published already: it is this event

    def _hold_early(self, ev) -> None:
        run = self._run
        early = run.early if run is not None else None
        if early is not None:
            early.append(ev)

    def _read_config(self) -> Config:
        """The config of the run starting now, read once per start: the one given or read
        before it (the command line, run_dir()), else the config file read again (a restart)."""
        cfg = self._peek_config()
        with self._config_lock:
            if self.config_path is not None and self._next_config is cfg:
                self._next_config = None  # the next start (a restart) reads the file again
        return cfg

    def _peek_config(self) -> Config:
        """The next start's config: the file read (its --set applied) when nothing read it yet,
        and kept for that start."""
        with self._config_lock:
            if self._next_config is None:
                self._next_config = apply_overrides(load_config(self.config_path),
                                                    self.overrides)
            cfg = self._next_config
        if self.new_run:  # picked once: a restart resumes the folder this run started in
            if self._fresh_name is None:
                self._asked_name = cfg.run.name
                self._fresh_name = cfg.run.name if self.resume else self._pick_fresh_name(cfg)
            cfg.run.name = self._fresh_name
        return cfg

    def _pick_fresh_name(self, cfg: Config) -> str:
        """The first free run.name-N beside an earlier run; on several nodes node 0's pick,
        which the others learn through the store (each would otherwise look at its own disk and
        they would write different folders)."""
        def pick() -> str:
            return fresh_name(cfg.run.output_dir, cfg.run.name)

        if self.nodes is None:
            return pick()

        def waiting() -> None:
            self.bus.publish(Log(level="info", source="nodes", message=(
                f"waiting for node 0 to name the run folder (a fresh one beside "
                f"{Path(cfg.run.output_dir) / cfg.run.name})")))

        return self.nodes.agree("run.name", pick, cfg.nodes.timeout_s, waiting=waiting,
                                stopped=lambda: self._stop_waiting.is_set() or (
                                    self._run is not None and self._run.stop.is_set()))

    # -- how the config was read, as the run's records say it ----------------------------------
    def _renamed(self) -> str | None:
        """The run.name that --new-run replaced with a fresh one (None: the name stands)."""
        if self._fresh_name and self._fresh_name != self._asked_name:
            return self._asked_name
        return None

    def _max_steps_from(self) -> str:
        """Which setting ends the run at run.max_steps (TrainingPlan names it)."""
        return "--max-steps" if self.max_steps is not None else "run.max_steps"
