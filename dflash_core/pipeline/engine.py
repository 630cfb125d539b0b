"""The in-process engine: control, the lifecycle of one run at a time, and its worker threads.

One supervisor thread per run walks idle -> preflight -> loading -> warmup -> training and ends in
finished, aborted or failed. Workers (a loader and a target stage per target device, a drafter
stage per drafter device, a telemetry sampler) only ever talk to the operator through events on
the bus. Any exception in any of them becomes an Error event, sets the run's stop flag and sends
the run to ``failed``; the process never dies and the engine waits for the next command.
Everything a run owns lives in its ``Run`` (run.py), made at start and dropped at the end.
"""

from __future__ import annotations

import functools
import gc
import threading
import time
from pathlib import Path

import torch
from transformers.utils import logging as hf_logging

from dflash_core.planning.allocator import apply_card_limit, configure_allocator
from dflash_core.models.compile_guard import serialize_triton_autotuning
from dflash_core.config import (Config, ConfigError, NodesConfig, TelemetryConfig,
                                apply_overrides, load_config, recipe_text, save_config)
from dflash_core.data import Prefetcher
from dflash_core.persist.data_position import DataPosition
from dflash_core.pipeline.drafter_stage import DrafterStage
from dflash_core.observe.errors import error_event
from dflash_core.observe.bus import EventBus
from dflash_core.observe.events import (
    TERMINAL_STATES, WORKER_FAILED, WORKER_STOPPED, Error, Log, QueueDepth, RunEnded, RunStarted,
    StateChanged, TrainingPlan, WorkerStatus, prefetch_queue,
)
from dflash_core.pipeline.hs_queue import HiddenStateQueue
from dflash_core.planning.layout_advice import LayoutAdvisor
from dflash_core.multinode.node_link import NodeLink
from dflash_core.multinode.nodes import NodeFailure, NodeGroup, node_dir_name, node_info
from dflash_core.planning.preflight import demo_log_progress, device_label, prepare, resolve_devices
from dflash_core.persist.resume import (
    check_resume_data, check_resume_nodes, check_resume_optimizer, expected_drafter_config,
    load_for_resume,
)
from dflash_core.pipeline.run import Run
from dflash_core.persist.run_folder import fresh_name, refuse_if_used
from dflash_core.observe.sinks.run_sinks import RunSinks
from dflash_core.models.target import LoadAborted
from dflash_core.pipeline.target_stage import TargetStage
from dflash_core.observe.telemetry import TelemetrySampler
from dflash_core.models.trainer import ANCHOR_PAD, StepBarrier, build_replicas, prepare_batch
from dflash_core.units import GiB
from dflash_core.observe.watchdog import Watchdog, format_stack, thread_stack, where
from dflash_core.pipeline.workers import POLL_S, Stopped, UpstreamFailed

# Workers check the stop flag between layers (targets) and micro-groups (drafters), so they end
# within about one such unit of GPU work. After JOIN_TIMEOUT_S the teardown says which are still
# busy; it waits up to GIVE_UP_S in all before ending the run without them (a hung kernel or
# collective), and then skips the abort checkpoint rather than save weights a step may be writing.
JOIN_TIMEOUT_S = 5.0
GIVE_UP_S = 60.0


def free_cuda_caches() -> None:
    """Give the run's cached device memory back: the caching allocator's free blocks, and the
    cuBLAS workspaces PyTorch keeps per (handle, stream) through that allocator (32 MiB each on
    recent GPUs, one per worker thread that ran a matmul: the 96 MiB a run left allocated)."""
    if not torch.cuda.is_available():
        return
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is not None:
        clear()
    torch.cuda.empty_cache()


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
        self._state = "idle"
        self._lock = threading.RLock()
        self._supervisor: threading.Thread | None = None
        self._run: Run | None = None  # the current (or last) run
        self._restarts_pending = 0  # restart() calls whose new run has not started yet
        self.runs_started = 0  # start() calls that began a run (each ends in one RunEnded)
        self.runs_ended = 0  # RunEnded events published
        self.final_status: str | None = None
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
        return self._state

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
                    "stop flag; quit and start the process again", fatal=True, phase=self._state))
                return
            self._run = Run()
            self._supervisor = threading.Thread(target=self._supervise, args=(self._run,),
                                                name="engine", daemon=True)
            self.runs_started += 1
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
                        error_kind="internal", source="engine", phase=self._state, fatal=False,
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
        if self.nodes is None:
            return cfg.run_dir
        return cfg.run_dir / node_dir_name(self.nodes.rank)

    def wait(self, timeout: float | None = None) -> str:
        """Block until the run reaches a terminal state (or timeout); returns the state."""
        self.join(timeout)
        return self._state

    # -- state and errors ---------------------------------------------------------------------
    def _set_state(self, state: str, reason: str = "") -> None:
        with self._lock:
            prev = self._state
            if prev == state:
                return
            self._state = state
        self.bus.publish(StateChanged(state=state, previous=prev, reason=reason))

    def _fail(self, run: Run, ev: Error) -> None:
        with self._lock:
            first = run.failure is None
            if first:
                run.failure = ev
            run.stop.set()
        self.bus.publish(ev if first else Error(**{**ev.__dict__, "fatal": False}))

    def _watch_fatal(self, ev) -> None:
        # A critical sink (events.jsonl, train.log) that breaks ends the run: we would lose records.
        run = self._run
        if isinstance(ev, Error) and ev.fatal and ev.source.startswith("sink:") \
                and run is not None and self._state not in TERMINAL_STATES \
                and self._state != "idle":
            with self._lock:
                if run.failure is None:
                    run.failure = ev
                run.stop.set()

    def _hold_early(self, ev) -> None:
        run = self._run
        early = run.early if run is not None else None
        if early is not None:
            early.append(ev)

    # -- worker threads ------------------------------------------------------------------------
    def _guard(self, run: Run, source: str, role: str, device: str, fn) -> None:
        """Run a worker body; turn its exception into an Error event and a failed run. A target
        or drafter publishes its last state here, whichever way its body ends: what the body
        returns (a target's "done" when its data ran out), else stopped or failed."""
        run.heartbeats.beat("starting")  # from now on the watchdog watches this thread
        last, detail = None, ""
        try:
            last = fn()
            stopped = True
        except Stopped:
            stopped = True
        except UpstreamFailed as up:
            stopped, detail = True, f"{up.source} failed"  # the Error names the one that did
            self._fail(run, error_event(up.cause, source=up.source, role=up.role, device=device,
                                        phase=self._state))
        except BaseException as exc:  # noqa: BLE001 - every failure must surface
            stopped = isinstance(exc, LoadAborted) and run.stop.is_set()
            if not stopped:
                self._fail(run, error_event(exc, source=source, role=role, device=device,
                                            phase=self._state))
                self.bus.publish(WorkerStatus(worker=source, role=role, device=device,
                                              status=WORKER_FAILED, detail=str(exc)[:200]))
        if stopped and role in ("target", "drafter"):
            self.bus.publish(WorkerStatus(worker=source, role=role, device=device,
                                          status=last or WORKER_STOPPED, detail=detail))

    def _thread(self, run: Run, name: str, role: str, device: str, fn) -> threading.Thread:
        t = threading.Thread(target=self._guard, args=(run, name, role, device, fn),
                             name=name, daemon=True)
        run.threads.append(t)
        t.start()
        return t

    # -- the run --------------------------------------------------------------------------------
    def _supervise(self, run: Run) -> None:
        run.heartbeats.beat("preflight")
        try:
            self._set_state("preflight")
            self._set_up(run)
            if not run.stop.is_set():
                self._load(run)
            if not run.stop.is_set():
                self._train(run)
        except Stopped:
            pass
        except BaseException as exc:  # noqa: BLE001
            self._fail(run, error_event(exc, source="engine", role="engine", device="",
                                        phase=self._state))
        finally:
            self._teardown(run)

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

    def _set_up(self, run: Run) -> None:
        """Everything before tens of GB of weights load, in order: read the config, open the
        run's records, announce the run, join the other nodes, run the preflight checks
        (planning/preflight.py), find the checkpoint to resume."""
        hf_logging.disable_progress_bar()  # its bars write behind the dashboard's back
        try:
            cfg = run.config = self._read_config()
        except NodeFailure as exc:  # waiting for node 0's run folder name
            if exc.ending != "aborted":  # an abort here or on node 0 ends the run as aborted
                raise
            run.abort_requested = True
            raise Stopped() from exc
        if self.nodes is not None:
            # Made first: a run that ends before it joins still tells the others (farewell).
            run.link = self._link(run, cfg.nodes, cfg.telemetry.stall_floor_s)
        # Before anything else can hang: a stuck read in preflight is reported like any stall.
        watchdog = Watchdog(run.heartbeats, self.bus.publish, run.stop, cfg.telemetry.stall_floor_s)
        self._thread(run, "watchdog", "watchdog", "host", watchdog.run)
        self._open_records(run, cfg)
        self._announce(run, cfg)
        if self.nodes is not None:
            # With the run's records open (a failure to join is in its events and train.log),
            # before it reads any checkpoint (a restart resumes from node 0's, written by now).
            self._join_nodes(run, cfg)
        self._check(run, cfg)
        if self.resume:
            self._find_resume(run, cfg)
        if (self.resume or run.prep.fitted) and self._lead:  # config.yaml: what the run uses
            save_config(cfg, cfg.run_dir / "config.yaml")

    @property
    def _lead(self) -> bool:
        """This process writes the run folder's shared files (config.yaml, checkpoints, W&B):
        on one node, or node 0 of several. Every node writes its own records in node-K/."""
        return self.nodes is None or self.nodes.rank == 0

    def _link(self, run: Run, nodes: NodesConfig, stall_s: float) -> NodeLink:
        link = NodeLink.from_config(nodes, stall_s, run, self.nodes, self.bus.publish,
                                    fail=lambda ev: self._fail(run, ev), restart=self.restart,
                                    restarting=lambda: self.restarting)
        self.bus.tap(link.note_error)
        return link

    def _open_records(self, run: Run, cfg: Config) -> None:
        """Make the run folder (refusing one that holds an earlier run), write the resolved
        config.yaml and attach the sinks, handing them the events published so far."""
        run_dir, records = cfg.run_dir, self._records_dir(cfg)
        if not self.resume:
            # never overwrite an earlier run's records (the run folder's own: node 0's)
            if self._lead:
                self._say_reused(refuse_if_used(run_dir))
            if records != run_dir:
                self._say_reused(refuse_if_used(records))
        if not self.resume and self._fresh_name and self._fresh_name != self._asked_name:
            why = (f"{Path(cfg.run.output_dir) / self._asked_name} holds an earlier run" if self._lead
                   else "the folder node 0 picked")  # on its disk, beside an earlier run
            self.bus.publish(Log(level="info", source="engine", message=(
                f"new run in {run_dir}: {why} (--new-run)")))
        try:
            records.mkdir(parents=True, exist_ok=True)
            if not self.resume and self._lead:  # a resume keeps it until its checkpoint fits
                save_config(cfg, run_dir / "config.yaml")
        except OSError as exc:
            raise ConfigError("run.output_dir", f"cannot write run folder {run_dir}: {exc}",
                              hint="set run.output_dir to a writable folder") from exc
        early, run.early = run.early or [], None
        run.sinks = RunSinks(self.bus, cfg, records, early)
        if self._lead:  # with the records open: the refusal is in events.jsonl and train.log too
            check_checkpoints_writable(run_dir)

    def _say_reused(self, attempts: str) -> None:
        if attempts:
            self.bus.publish(Log(level="info", source="engine", message=(
                f"starting in {attempts}: they ended before a step, so there is no run to keep")))

    def _announce(self, run: Run, cfg: Config) -> None:
        """Resolve the devices and publish RunStarted (and the allocator's settings on CUDA)."""
        run.target_devices, run.drafter_devices = resolve_devices(cfg)
        cuda = any(d.type == "cuda" for d in run.target_devices + run.drafter_devices)
        self.bus.publish(RunStarted(
            run_name=cfg.run.name, run_dir=str(self._records_dir(cfg)), config=cfg.to_dict(),
            targets=[device_label(d, i) for i, d in enumerate(run.target_devices)],
            drafters=[device_label(d, i) for i, d in enumerate(run.drafter_devices)],
            allocator=(self.allocator.conf or "PyTorch defaults") if cuda else "",
            resume=self.resume))
        if cuda:
            self.bus.publish(Log(level="info", source="engine", message=self.allocator.describe()))

    def _check(self, run: Run, cfg: Config) -> None:
        """The preflight (planning/preflight.py): every check that needs no weights, the demo's
        assets built; then W&B, whose settings it checked."""
        def check_stop():  # called as the demo's assets are built: progress too
            if run.stop.is_set():
                raise Stopped()
            run.heartbeats.beat("building the demo")
        run.prep = prepare(cfg, cfg.run_dir, run.target_devices, run.drafter_devices,
                           publish=self.bus.publish,
                           demo_progress=demo_log_progress(self.bus.publish, check_stop),
                           nodes=self.nodes.world if self.nodes is not None else 1,
                           checkpoints=self._lead)
        if self._lead:  # several nodes: W&B from node 0 alone
            run.sinks.add_wandb(cfg, cfg.run_dir)

    def _find_resume(self, run: Run, cfg: Config) -> None:
        """The newest intact checkpoint of this drafter's shape (None: nothing to resume)."""
        expected = expected_drafter_config(cfg, run.prep.target_path, run.prep.layer_ids,
                                           run.prep.mask_id)
        # Several nodes read one folder: node 0 alone moves a damaged checkpoint aside.
        run.resume_t0 = time.monotonic()  # the time from --resume to the first step is shown
        run.resume = load_for_resume(cfg.run_dir, expected, self.bus.publish,
                                     set_aside_damaged=self._lead)
        if run.resume is not None:
            check_resume_nodes(run.resume, self.nodes.world if self.nodes else 1)
            check_resume_optimizer(run.resume, cfg)
            check_resume_data(run.resume, run.data_identity(), cfg.data.allow_changed_data,
                              self.bus.publish)
            self.bus.publish(Log(level="info", source="engine", message=(
                f"resuming from {run.resume.path} (step {run.resume.step})")))

    def _join_nodes(self, run: Run, cfg: Config) -> None:
        """Several nodes: join the others (the first run of the process) and make this run's
        side of the step protocol."""
        if self.nodes.info.local_world > 1 and cfg.layout.device != "cpu":
            raise ConfigError("layout.device", f"torchrun started {self.nodes.info.local_world} "
                              "processes on this machine: each would use every GPU of layout.*",
                              hint="start one process per node: torchrun --nproc-per-node 1")
        link = run.link
        run.heartbeats.beat(f"joining {self.nodes.world} nodes")
        if not self.nodes.connected:
            try:
                self.nodes.connect(cfg.nodes.timeout_s, cuda=cfg.layout.device != "cpu"
                                   and torch.cuda.is_available(),
                                   waiting=lambda late: run.heartbeats.note(
                                       "waiting for " + ", ".join(f"node {k}" for k in late)
                                       + " to join"),
                                   stopped=run.stop.is_set)
            except NodeFailure as exc:
                link.over = True  # nothing more to tell anyone
                if exc.ending != "aborted":
                    raise
                self.bus.publish(Log(level="info", source="nodes", message=str(exc)))
                run.abort_requested = True
                raise Stopped() from exc
        self.bus.publish(Log(level="info", source="nodes", message=(
            f"node {self.nodes.rank} of {self.nodes.world} ({self.nodes.host}); "
            f"{'writes checkpoints and W&B' if self.nodes.rank == 0 else 'node 0 writes checkpoints'}")))
        link.start()
        if run.stop.is_set():
            raise Stopped()

    def _load(self, run: Run) -> None:
        cfg, prep = run.config, run.prep
        self._set_state("loading")
        limits: dict[int, int] = {}
        for index in sorted({d.index for d in run.target_devices + run.drafter_devices
                             if d.type == "cuda"}):
            limit = apply_card_limit(torch.device("cuda", index), cfg.layout.gpu_memory_gib)
            if cfg.layout.gpu_memory_gib:
                limits[index] = limit
                self.bus.publish(Log(level="info", source="engine", message=(
                    f"cuda:{index} limited to {limit / GiB:.1f} GiB (layout.gpu_memory_gib)")))
        self._start_telemetry(run, limits)
        world = len(run.target_devices)
        run.hs_queue = HiddenStateQueue(cfg.layout.hs_queue, world, self.bus.publish, run.stop,
                                        beat=run.heartbeats.beat)
        if run.resume:  # its data position names batches of the order it was written with
            wrote = int(run.resume.trainer_state.get("balance", 1))
            if wrote != prep.stream.balance:
                self.bus.publish(Log(level="info", source="engine", message=(
                    f"resume: batches ordered for {wrote} per step as the checkpoint's run did "
                    f"(this layout would balance {prep.stream.balance}; data.balance_steps)")))
                prep.stream.use_balance(wrote)
        run.position = DataPosition(lambda e: len(prep.stream.plan(e)), len(run.drafter_devices),
                                    run.resume.trainer_state if run.resume else None)
        # The loader threads make each batch's drafter anchors and labels (host work the
        # drafter's step would otherwise wait on); rounded as the drafter GPUs want them.
        for_drafter = functools.partial(
            prepare_batch, num_anchors=cfg.drafter.num_anchors,
            block_size=cfg.drafter.block_size, seed=cfg.run.seed,
            pad_to=ANCHOR_PAD if run.drafter_devices[0].type == "cuda" else 1)
        # Several nodes: node k's targets take global shards k*T .. k*T+T-1 of N*T.
        node, nodes = (self.nodes.rank, self.nodes.world) if self.nodes is not None else (0, 1)
        for rank, dev in enumerate(run.target_devices):
            name = prefetch_queue(rank)
            batches = prep.stream.iter_batches(run.position.start_epoch, run.position.start_done,
                                               worker=(node * world + rank, nodes * world))
            run.prefetchers.append(Prefetcher(
                batches, cfg.data.prefetch_batches, pin=dev.type == "cuda", name=f"loader-{rank}",
                prepare=for_drafter,
                stop=run.stop, on_depth=lambda d, c, n=name: self.bus.publish(
                    QueueDepth(name=n, depth=d, capacity=c)), beat=run.heartbeats.beat))
        if any(d.type == "cuda" for d in run.target_devices):
            serialize_triton_autotuning()  # targets' (and the evaluation's) FLA kernels
        for rank, dev in enumerate(run.target_devices):
            label = device_label(dev, rank)
            stage = TargetStage(
                rank, dev, label, target_path=prep.target_path, dtype=cfg.target.dtype,
                attn_implementation=cfg.target.attn_implementation, layer_ids=prep.layer_ids,
                prefetcher=run.prefetchers[rank], hs_queue=run.hs_queue,
                publish=self.bus.publish, stop=run.stop, heartbeats=run.heartbeats)
            run.targets.append(stage)
            self._thread(run, stage.name, "target", label, stage.run)
        for stage in run.targets:
            while not stage.loaded.is_set():
                if run.stop.wait(POLL_S):
                    raise Stopped()
                run.heartbeats.beat("waiting for the targets to load")

    def _start_telemetry(self, run: Run, limits: dict[int, int]) -> None:
        roles: dict[int, str] = {}
        for d in run.target_devices:
            if d.type == "cuda":
                roles[d.index] = "target"
        for d in run.drafter_devices:
            if d.type == "cuda":
                roles[d.index] = "target+drafter" if roles.get(d.index) == "target" else "drafter"
        sampler = TelemetrySampler(self.bus.publish, run.config.telemetry.interval_s, roles,
                                   run.stop, raise_errors=True, limits=limits,
                                   beat=run.heartbeats.beat)
        # In a guarded thread: a sampler crash is a worker failure like any other.
        self._thread(run, "telemetry", "telemetry", "host", sampler.run)

    def _train(self, run: Run) -> None:
        cfg = run.config
        self._set_state("warmup")
        run.replicas = build_replicas(cfg, run.targets[0].model, run.drafter_devices,
                                      layer_ids=run.prep.layer_ids, mask_id=run.prep.mask_id,
                                      resume=run.resume)
        if run.resume is not None:
            run.step = run.resume.step
        run.start_writer(self.bus.publish)
        run.barrier = StepBarrier(len(run.replicas), run.stop)
        gpus = torch.cuda.device_count() if run.drafter_devices[0].type == "cuda" else 0
        run.advisor = LayoutAdvisor(self.bus.publish, len(run.target_devices),
                                    len(run.drafter_devices), gpus)
        self.bus.tap(run.advisor)  # says once which side bounds the run and the balancing split
        run.last_step_t = time.monotonic()
        # Where it starts and which limit ends it: said once, for every reader alike.
        self.bus.publish(TrainingPlan(
            start_step=run.step, total_steps=run.total_steps, epochs=cfg.optim.epochs,
            epoch_steps=run.prep.epoch_steps, max_steps=cfg.run.max_steps,
            max_steps_from="--max-steps" if self.max_steps is not None else "run.max_steps",
            targets=len(run.target_devices), drafters=len(run.replicas),
            recipe=recipe_text(cfg.to_dict())))
        if run.step >= run.total_steps:
            run.finished = True
            return

        def on_step():
            run.step_once(self.bus.publish, on_metrics=lambda: self._set_state("training")
                          if self._state == "warmup" else None)
        for rank, rep in enumerate(run.replicas):
            label = device_label(rep.device, rank)
            stage = DrafterStage(rank, rep, label, hs_queue=run.hs_queue, position=run.position,
                                 barrier=run.barrier, grad_accum=cfg.optim.grad_accum,
                                 seed=cfg.run.seed, on_step=on_step, step_of=lambda: run.step,
                                 publish=self.bus.publish,
                                 stop=run.stop, heartbeats=run.heartbeats)
            self._thread(run, stage.name, "drafter", label, stage.run)
        while not run.stop.wait(POLL_S):
            run.heartbeats.beat("supervising training")

    # -- teardown ------------------------------------------------------------------------------
    def _join_workers(self, run: Run) -> list[str]:
        """Close the prefetchers and join every worker; returns the names still running."""
        t0 = time.monotonic()
        for pf in run.prefetchers:
            pf.close(timeout=JOIN_TIMEOUT_S)
        warned = False
        while True:
            alive = [t for t in run.threads if t.is_alive()]
            waited = time.monotonic() - t0
            if not alive or waited >= GIVE_UP_S:
                break
            if waited >= JOIN_TIMEOUT_S and not warned:
                warned = True
                self.bus.publish(Log(level="warning", source="engine", message=(
                    f"waiting for {[t.name for t in alive]} to finish their current GPU call "
                    f"(up to {GIVE_UP_S:.0f} s)")))
            alive[0].join(min(POLL_S, GIVE_UP_S - waited))
        stuck = [t.name for t in run.threads if t.is_alive()]
        if stuck:
            self.bus.publish(Log(level="warning", source="engine", message=(
                f"threads still running after {GIVE_UP_S:.0f} s: {stuck}")))
        return stuck

    def _teardown(self, run: Run) -> None:
        run.early = None
        run.stop.set()
        stuck = self._join_workers(run)
        failed = run.failure is not None
        status = "failed" if failed else ("finished" if run.finished and not run.abort_requested
                                          else "aborted")
        busy_drafters = [n for n in stuck if n.startswith("drafter")]
        if self.nodes is not None:
            # A run whose config could not be read has no link yet: it says farewell by the
            # defaults of nodes.* (the others wait for it at the start of the run).
            link = run.link or self._link(run, NodesConfig(), TelemetryConfig.stall_floor_s)
            link.farewell(status)
            self.bus.untap(link.note_error)
        # Another node's failure leaves this node's weights at the last step all nodes took.
        saves = not failed or run.peer_failed
        if busy_drafters and saves and run.step > 0:
            self.bus.publish(Log(level="warning", source="engine", message=(
                f"no {'final' if run.finished else 'abort'} checkpoint: {busy_drafters} still "
                f"running after {GIVE_UP_S:.0f} s could be changing the weights; the last "
                f"periodic checkpoint stands")))
        if saves and run.replicas and run.step > 0 and not busy_drafters:
            try:
                if status == "finished" or run.config.checkpoint.on_abort:
                    run.save_checkpoint("final" if status == "finished" else "abort",
                                        self.bus.publish)
                if status == "finished" and run.config.data.eval_prompts and not failed:
                    run.evaluate(self.bus.publish)
            except BaseException as exc:  # noqa: BLE001
                self._fail(run, error_event(exc, source="engine", role="engine", device="",
                                            phase="teardown"))
                status = "failed"
        try:
            run.close_writer()  # after the last write is durable
        except BaseException as exc:  # noqa: BLE001
            self._fail(run, error_event(exc, source="engine", role="engine", device="",
                                        phase="teardown"))
            status = "failed"
        if run.advisor is not None:
            self.bus.untap(run.advisor)
        # Free the run's memory before anything else can start.
        run.release()
        gc.collect()
        free_cuda_caches()
        reason = run.failure.message if run.failure is not None else ""
        self.final_status = status
        self._set_state(status, reason)
        self.bus.publish(RunEnded(status=status, step=run.step,
                                  seconds=time.monotonic() - run.started_at, reason=reason))
        self.runs_ended += 1
        self.bus.drain(timeout=5.0)
        if run.sinks is not None:
            run.sinks.close()
            run.sinks = None


def check_checkpoints_writable(run_dir: Path) -> None:
    """A checkpoints folder that is there but cannot take a checkpoint (a file of that name, a
    folder without write permission) is found now, not at the first save after an hour of
    training. One that is not there yet is made, in the writable run folder, at the first save."""
    import os

    from dflash_core.persist.checkpoint import CHECKPOINTS

    folder = run_dir / CHECKPOINTS
    if not os.path.lexists(folder):
        return
    try:
        if not folder.is_dir():
            raise NotADirectoryError(f"{folder} is a file, not a folder")
        probe = folder / f".write-probe-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        raise ConfigError("run.output_dir", f"cannot write checkpoints to {folder}: {exc}",
                          hint=f"make {folder} a folder you can write (move a file of that name "
                               "away), or set run.output_dir elsewhere") from exc
