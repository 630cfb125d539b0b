"""The in-process engine: lifecycle, worker threads, queues, control, error capture.

One supervisor thread per run walks idle -> preflight -> loading -> warmup -> training and ends in
finished, aborted or failed. Workers (a loader and a target thread per target device, a drafter
thread per drafter device, a telemetry sampler) only ever talk to the operator through events on
the bus. Any exception in any of them becomes an Error event, sets the shared stop flag and sends
the run to ``failed``; the process never dies and the engine waits for the next command.
"""

from __future__ import annotations

import gc
import queue
import threading
import time
from collections import defaultdict
from pathlib import Path

import torch

from . import checkpoint as ckpt
from .config import Config, ConfigError, load_config, save_config
from .bus import EventBus
from .errors import error_event
from .events import (
    HS_QUEUE, TERMINAL_STATES, WORKER_DONE, WORKER_FAILED, WORKER_LOADING, WORKER_RUNNING,
    WORKER_STOPPED, WORKER_WARMUP, Checkpoint, Error, EvalResult, LoadProgress, Log,
    QueueDepth, RunEnded, RunStarted, StateChanged, StepMetrics, TargetMetrics, WorkerStatus,
    prefetch_queue,
)
from .preflight import demo_log_progress, device_label, prepare, resolve_devices

# Workers check the stop flag between layers (targets) and micro-groups (drafters), so they end
# within about one such unit of GPU work. After JOIN_TIMEOUT_S the teardown says which are still
# busy; it waits up to GIVE_UP_S in all before ending the run without them (a hung kernel or
# collective), and then skips the abort checkpoint rather than save weights a step may be writing.
JOIN_TIMEOUT_S = 5.0
GIVE_UP_S = 60.0
POLL_S = 0.1  # every blocking wait is at most this long, then the stop flag is checked


def use_device(dev: torch.device) -> None:
    """Make ``dev`` this thread's current CUDA device (a per-thread setting): kernels that launch
    on the current device (Triton's, e.g. flash-linear-attention's) then run where the tensors are."""
    if dev.type == "cuda":
        torch.cuda.set_device(dev)


class _Stopped(Exception):
    """Raised inside a worker when the stop flag ends a wait."""


class Engine:
    """Owns one run at a time. Thread-safe control: start, abort, restart, shutdown."""

    def __init__(self, config: Config | None = None, *, config_path: str | Path | None = None,
                 bus: EventBus | None = None, resume: bool = False, max_steps: int | None = None):
        if config is None and config_path is None:
            raise ValueError("Engine needs a config or a config_path")
        self.bus = bus or EventBus()
        self._owns_bus = bus is None
        self.config_path = Path(config_path) if config_path else None
        self._given_config = config
        self.resume = resume
        self.max_steps = max_steps
        self._state = "idle"
        self._lock = threading.RLock()
        self._supervisor: threading.Thread | None = None
        self._stop = threading.Event()
        self._restarts_pending = 0  # restart() calls whose new run has not started yet
        self.runs_started = 0  # start() calls that began a run (each ends in one RunEnded)
        self._sinks: list = []
        self._subs: list = []
        self.final_status: str | None = None
        self.config: Config | None = None
        self._early: list | None = None  # events of this run published before its sinks exist
        self.bus.tap(self._watch_fatal)
        self.bus.tap(self._hold_early)

    # -- control (the Controller protocol) -------------------------------------------------------
    @property
    def state(self) -> str:
        return self._state

    def start(self) -> None:
        with self._lock:
            if self._supervisor is not None and self._supervisor.is_alive():
                return
            # A worker of the last run that never ended would read the new run's stop flag and
            # keep going inside it: refuse to start rather than run two pipelines at once.
            stuck = [t.name for t in getattr(self, "_threads", []) if t.is_alive()]
            if stuck:
                self.bus.publish(Error(
                    error_kind="internal", source="engine", message=f"threads of the last run are "
                    f"still running: {stuck}", hint="a worker is stuck in a call that ignores the "
                    "stop flag; quit and start the process again", fatal=True, phase=self._state))
                return
            self._stop = threading.Event()
            self._abort_requested = False
            self._failure: Error | None = None
            self._supervisor = threading.Thread(target=self._supervise, name="engine", daemon=True)
            self.runs_started += 1
            self._supervisor.start()

    def abort(self) -> None:
        with self._lock:
            # The supervisor, not the state, says whether a run is live: right after start()
            # the state is still idle (or the last run's end) and the abort must not be lost.
            if self._supervisor is None or not self._supervisor.is_alive():
                return
            self._abort_requested = True
            self._stop.set()

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
        if self._owns_bus:
            self.bus.close(timeout=5.0)

    def join(self, timeout: float | None = None) -> bool:
        sup = self._supervisor
        if sup is not None:
            sup.join(timeout)
            return not sup.is_alive()
        return True

    def run_dir(self) -> Path | None:
        """The run folder the config names, if the config can be read (for post-mortems)."""
        try:
            return self._read_config().run_dir
        except (ConfigError, OSError):
            return None

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

    def _fail(self, ev: Error) -> None:
        with self._lock:
            first = self._failure is None
            if first:
                self._failure = ev
            self._stop.set()
        self.bus.publish(ev if first else Error(**{**ev.__dict__, "fatal": False}))

    def _watch_fatal(self, ev) -> None:
        # A critical sink (events.jsonl, train.log) that breaks ends the run: we would lose records.
        if isinstance(ev, Error) and ev.fatal and ev.source.startswith("sink:") \
                and self._state not in TERMINAL_STATES and self._state != "idle":
            with self._lock:
                if self._failure is None:
                    self._failure = ev
                self._stop.set()

    def _hold_early(self, ev) -> None:
        early = self._early
        if early is not None:
            early.append(ev)

    def _guard(self, source: str, role: str, device: str, fn, *args) -> None:
        """Run a worker body; turn its exception into an Error event and a failed run."""
        try:
            fn(*args)
            stopped = True
        except _Stopped:
            stopped = True
        except BaseException as exc:  # noqa: BLE001 - every failure must surface
            from .target import LoadAborted
            stopped = isinstance(exc, LoadAborted) and self._stop.is_set()
            if not stopped:
                self._fail(error_event(exc, source=source, role=role, device=device,
                                       phase=self._state))
                self.bus.publish(WorkerStatus(worker=source, role=role, device=device,
                                              status=WORKER_FAILED, detail=str(exc)[:200]))
        if stopped and role == "drafter":  # targets report "done" themselves
            self.bus.publish(WorkerStatus(worker=source, role=role, device=device,
                                          status=WORKER_STOPPED))

    def _thread(self, name: str, role: str, device: str, fn, *args) -> threading.Thread:
        t = threading.Thread(target=self._guard, args=(name, role, device, fn, *args),
                             name=name, daemon=True)
        self._threads.append(t)
        t.start()
        return t

    # -- the run --------------------------------------------------------------------------------
    def _supervise(self) -> None:
        t0 = time.monotonic()
        self._threads: list[threading.Thread] = []
        self._prefetchers: list = []
        self._targets: dict[int, object] = {}
        self._replicas: list = []
        self._finished = False
        self.step = 0
        self._saved_step = -1
        self._early = []
        try:
            self._set_state("preflight")
            self._preflight()
            if not self._stop.is_set():
                self._load()
            if not self._stop.is_set():
                self._train()
        except _Stopped:
            pass
        except BaseException as exc:  # noqa: BLE001
            self._fail(error_event(exc, source="engine", role="engine", device="",
                                   phase=self._state))
        finally:
            self._teardown(t0)

    def _read_config(self) -> Config:
        cfg = load_config(self.config_path) if self.config_path else self._given_config
        if self.max_steps is not None:
            cfg.run.max_steps = self.max_steps
        return cfg

    _label = staticmethod(device_label)

    def _attach_sinks(self, cfg: Config, run_dir: Path) -> None:
        from .sinks.jsonl import JsonlSink
        from .sinks.textlog import TextLogSink

        self._detach_sinks()
        # The run's first events (StateChanged to preflight) went out before the run folder was
        # known; hand them to the sinks first so events.jsonl holds the whole run.
        early, self._early = self._early or [], None
        jsonl = JsonlSink(run_dir / "events.jsonl")
        text = TextLogSink(run_dir / "train.log", every_s=cfg.run.log_every_s)
        self._sinks = [jsonl, text]
        self._subs = [self.bus.subscribe("jsonl", jsonl, critical=True),
                      self.bus.subscribe("textlog", text, critical=True)]
        if cfg.wandb.enabled and cfg.wandb.mode != "disabled":
            from .sinks.wandb_sink import WandbSink
            wb = WandbSink(cfg.wandb, run_dir, cfg.run.name, cfg.to_dict(), self.bus.publish)
            self._sinks.append(wb)
            self._subs.append(self.bus.subscribe("wandb", wb, critical=False))
        for ev in early:
            for sub in self._subs:
                sub.offer(ev)

    def _detach_sinks(self) -> None:
        for sub in self._subs:
            self.bus.unsubscribe(sub, timeout=5.0)
        for sink in self._sinks:
            try:
                sink.close()
            except Exception:
                pass
        self._sinks, self._subs = [], []

    def _preflight(self) -> None:
        """Everything that can be checked before tens of GB of weights load."""
        # Library progress bars write to the terminal behind the dashboard's back.
        from transformers.utils import logging as hf_logging
        hf_logging.disable_progress_bar()
        cfg = self._read_config()
        self.config = cfg
        run_dir = cfg.run_dir
        try:
            run_dir.mkdir(parents=True, exist_ok=True)
            save_config(cfg, run_dir / "config.yaml")
        except OSError as exc:
            raise ConfigError("run.output_dir", f"cannot write run folder {run_dir}: {exc}",
                              hint="set run.output_dir to a writable folder") from exc
        self._attach_sinks(cfg, run_dir)
        tdev, ddev = resolve_devices(cfg)
        self.target_devices, self.drafter_devices = tdev, ddev
        self.bus.publish(RunStarted(
            run_name=cfg.run.name, run_dir=str(run_dir), config=cfg.to_dict(),
            targets=[self._label(d, i) for i, d in enumerate(tdev)],
            drafters=[self._label(d, i) for i, d in enumerate(ddev)]))
        prep = prepare(cfg, run_dir, tdev, ddev, publish=self.bus.publish,
                       demo_progress=demo_log_progress(self.bus.publish, self._check_stop))
        self.target_path, self.layer_ids, self.mask_id = prep.target_path, prep.layer_ids, prep.mask_id
        self.dataset, self.eval_indices, self.stream = prep.dataset, prep.eval_indices, prep.stream
        self.total_steps = prep.total_steps

        self.resume_state = None
        if self.resume:
            latest = ckpt.latest_checkpoint(run_dir)
            if latest is not None:
                self.resume_state = ckpt.load_checkpoint(latest)
                self.bus.publish(Log(level="info", source="engine",
                                     message=f"resuming from {latest} (step {self.resume_state.step})"))

    def _check_stop(self) -> None:
        if self._stop.is_set():
            raise _Stopped()

    # -- loading -------------------------------------------------------------------------------
    def _load(self) -> None:
        from .data import Prefetcher

        cfg = self.config
        self._set_state("loading")
        self._start_telemetry(cfg)
        self.hs_queue: queue.Queue = queue.Queue(maxsize=cfg.layout.hs_queue)
        self._counters = defaultdict(float)
        self._counter_lock = threading.Lock()
        self._targets_done = 0
        self._done_batches: dict[int, set[int]] = defaultdict(set)
        start_epoch, done = 0, set()
        if self.resume_state is not None:
            tr = self.resume_state.trainer_state
            start_epoch, done = int(tr["epoch"]), set(int(i) for i in tr["done"])
            self._done_batches[start_epoch] |= done
        world = len(self.target_devices)
        for rank, dev in enumerate(self.target_devices):
            name = prefetch_queue(rank)
            pf = Prefetcher(
                self.stream.iter_batches(start_epoch, done, worker=(rank, world)),
                cfg.data.prefetch_batches, pin=dev.type == "cuda", name=f"loader-{rank}",
                stop=self._stop,
                on_depth=lambda d, c, n=name: self.bus.publish(QueueDepth(name=n, depth=d, capacity=c)))
            self._prefetchers.append(pf)
        for rank, dev in enumerate(self.target_devices):
            self._thread(f"target-{rank}", "target", self._label(dev, rank), self._target_worker,
                         rank, dev)
        while len(self._targets) < world:
            if self._stop.wait(POLL_S):
                raise _Stopped()

    def _start_telemetry(self, cfg: Config) -> None:
        try:
            from .telemetry import TelemetrySampler
        except ImportError:
            return
        roles: dict[int, str] = {}
        for d in self.target_devices:
            if d.type == "cuda":
                roles[d.index] = "target"
        for d in self.drafter_devices:
            if d.type == "cuda":
                roles[d.index] = "target+drafter" if roles.get(d.index) == "target" else "drafter"

        def body():
            # Run in this guarded thread: a sampler crash is a worker failure like any other.
            TelemetrySampler(self.bus.publish, cfg.telemetry.interval_s, roles, self._stop,
                             raise_errors=True).run()
        self._thread("telemetry", "telemetry", "host", body)

    def _target_worker(self, rank: int, dev: torch.device) -> None:
        from .target import ForwardInterrupted, load_target

        cfg = self.config
        name, label = f"target-{rank}", self._label(dev, rank)
        use_device(dev)
        self.bus.publish(WorkerStatus(worker=name, role="target", device=label, status=WORKER_LOADING))

        def progress(info) -> None:
            self.bus.publish(LoadProgress(
                worker=name, device=label, bytes_loaded=info.bytes_loaded,
                bytes_total=info.bytes_total, shards_loaded=info.shards_loaded,
                shards_total=info.shards_total, seconds=info.seconds, done=info.done,
                memory_after=info.memory_after))

        dtype = cfg.target.dtype if dev.type == "cuda" else "float32"
        tm = load_target(self.target_path, device=dev, dtype=dtype,
                         attn_implementation=cfg.target.attn_implementation, progress=progress,
                         stop=self._stop)
        self._targets[rank] = tm
        self.bus.publish(WorkerStatus(worker=name, role="target", device=label, status=WORKER_WARMUP,
                                      detail="first forward (kernel compilation)"))
        pf = self._prefetchers[rank]
        batches, tokens, blocked, starved = 0, 0, 0.0, 0.0
        window_t0 = time.monotonic()
        while not self._stop.is_set():
            t = time.monotonic()
            try:
                batch = pf.get(timeout=POLL_S)
            except BaseException as exc:
                # The loader thread failed: name it, not this target.
                self._fail(error_event(exc, source=f"loader-{rank}", role="loader", device=label,
                                       phase=self._state))
                raise _Stopped() from exc
            if batch is None:
                if pf.exhausted:
                    break
                starved += time.monotonic() - t
                continue
            starved += time.monotonic() - t
            try:
                feats = tm.features(batch.input_ids, batch.attention_mask, self.layer_ids,
                                    stop=self._stop)
            except ForwardInterrupted:
                raise _Stopped() from None
            if batches == 0:
                self.bus.publish(WorkerStatus(worker=name, role="target", device=label,
                                              status=WORKER_RUNNING))
            t = time.monotonic()
            self._put_hs((batch, feats))
            blocked += time.monotonic() - t
            with self._counter_lock:
                self._counters["target_blocked"] += time.monotonic() - t
            batches += 1
            tokens += batch.num_tokens
            now = time.monotonic()
            if now - window_t0 >= 1.0:
                span = now - window_t0
                self.bus.publish(TargetMetrics(worker=name, device=label, batches=batches,
                                               tokens_per_s=tokens / span,
                                               blocked_frac=blocked / span,
                                               starved_frac=starved / span))
                tokens, blocked, starved, window_t0 = 0, 0.0, 0.0, now
        with self._counter_lock:
            self._targets_done += 1
        self.bus.publish(WorkerStatus(worker=name, role="target", device=label, status=WORKER_DONE))

    def _put_hs(self, item) -> None:
        while True:
            if self._stop.is_set():
                raise _Stopped()
            try:
                self.hs_queue.put(item, timeout=POLL_S)
                break
            except queue.Full:
                continue
        self._report_hs()

    def _report_hs(self) -> None:
        now = time.monotonic()
        if now - self._counters.get("hs_reported", 0.0) >= 0.2:
            self._counters["hs_reported"] = now
            self.bus.publish(QueueDepth(name=HS_QUEUE, depth=self.hs_queue.qsize(),
                                        capacity=self.hs_queue.maxsize))

    # -- training ------------------------------------------------------------------------------
    def _build_replicas(self):
        from .drafter import DFlashDrafter, build_drafter_config
        from .trainer import make_replicas

        cfg = self.config
        t0 = self._targets[0]
        if self.resume_state is not None:
            dcfg = DFlashDrafter.config_from_dict(self.resume_state.drafter_config)
            drafter = DFlashDrafter(dcfg)
            drafter.load_state_dict(self.resume_state.drafter_state)
        elif cfg.drafter.init_from:
            drafter = DFlashDrafter.load(cfg.drafter.init_from)
        else:
            d = cfg.drafter
            dcfg = build_drafter_config(
                t0.model.config, num_layers=d.num_layers, target_layer_ids=self.layer_ids,
                block_size=d.block_size, mask_token_id=self.mask_id, hidden_size=d.hidden_size,
                intermediate_size=d.intermediate_size, num_attention_heads=d.num_attention_heads,
                num_key_value_heads=d.num_key_value_heads)
            torch.manual_seed(cfg.run.seed)
            drafter = DFlashDrafter(dcfg)
        embed = torch.nn.Embedding.from_pretrained(t0.embed_tokens.weight.detach().clone(), freeze=True)
        head = torch.nn.Linear(t0.hidden_size, t0.vocab_size, bias=False)
        head.weight = torch.nn.Parameter(t0.lm_head.weight.detach().clone(), requires_grad=False)
        if self.drafter_devices[0].type == "cpu":
            embed, head = embed.float(), head.float()
        reps = make_replicas(drafter, self.drafter_devices, cfg, embed, head)
        if self.resume_state is not None:
            for r in reps:
                r.optimizer.load_state_dict(self.resume_state.optimizer_state)
            self.step = self.resume_state.step
        return reps

    def _train(self) -> None:
        from .trainer import RateMeter, StepBarrier

        self._set_state("warmup")
        self._replicas = self._build_replicas()
        self._barrier = StepBarrier(len(self._replicas), self._stop)
        self._rate = RateMeter()
        self._last_step_t = time.monotonic()
        self._pending: dict[int, list[tuple[int, int]]] = defaultdict(list)
        self.bus.publish(Log(level="info", source="engine",
                             message=f"training {self.total_steps} steps on "
                             f"{len(self.target_devices)} target(s) + {len(self._replicas)} drafter(s)"))
        if self.step >= self.total_steps:
            self._finished = True
            return
        for rank, rep in enumerate(self._replicas):
            self._thread(f"drafter-{rank}", "drafter", self._label(rep.device, rank),
                         self._drafter_worker, rank)
        while not self._stop.wait(POLL_S):
            pass

    def _hs_exhausted(self) -> bool:
        return self._targets_done >= len(self.target_devices) and self.hs_queue.empty()

    def _drafter_worker(self, rank: int) -> None:
        from .trainer import StepInterrupted

        cfg = self.config
        rep = self._replicas[rank]
        label = self._label(rep.device, rank)
        use_device(rep.device)
        self.bus.publish(WorkerStatus(worker=f"drafter-{rank}", role="drafter", device=label,
                                      status=WORKER_WARMUP, detail="first step (kernel compilation)"))
        first = True
        while not self._stop.is_set():
            got = 0
            while got < cfg.optim.grad_accum and not self._stop.is_set():
                t = time.monotonic()
                try:
                    batch, feats = self.hs_queue.get(timeout=POLL_S)
                except queue.Empty:
                    with self._counter_lock:
                        self._counters["drafter_wait"] += time.monotonic() - t
                    if self._hs_exhausted():
                        break
                    continue
                with self._counter_lock:
                    self._counters["drafter_wait"] += time.monotonic() - t
                self._report_hs()
                try:
                    rep.accumulate(batch, feats, cfg.run.seed, stop=self._stop)
                except StepInterrupted:
                    return
                del feats
                self._pending[rank].append((batch.epoch, batch.batch_index))
                got += 1
            if self._stop.is_set():
                return
            if not self._barrier.arrive(self._step):
                return
            if first:
                first = False
                self.bus.publish(WorkerStatus(worker=f"drafter-{rank}", role="drafter",
                                              device=label, status=WORKER_RUNNING))

    def _step(self) -> None:
        """Runs in the last drafter thread to reach the step barrier; the others wait."""
        from .trainer import reduce_and_step

        cfg = self.config
        if all(r.micro.weight_sum == 0 and r.micro.samples == 0 for r in self._replicas):
            if self._hs_exhausted():
                self._finish()
            return
        res = reduce_and_step(self._replicas, self.step, self.total_steps)
        self.step = res.step
        for pend in self._pending.values():
            for epoch, bi in pend:
                self._done_batches[epoch].add(bi)
            pend.clear()
        now = time.monotonic()
        span = max(now - self._last_step_t, 1e-9)
        self._last_step_t = now
        with self._counter_lock:
            wait = self._counters.pop("drafter_wait", 0.0)
            blocked = self._counters.pop("target_blocked", 0.0)
        tps, sps = self._rate.add(res.tokens, res.samples)
        self.bus.publish(StepMetrics(
            step=res.step, epoch=self._current_epoch(), loss=res.loss, lr=res.lr,
            grad_norm=res.grad_norm, tokens_per_s=tps, samples_per_s=sps, tau_tf=res.tau_tf,
            drafter_wait_frac=min(1.0, wait / (span * len(self._replicas))),
            target_blocked_frac=min(1.0, blocked / (span * len(self.target_devices))),
            padding_frac=res.padding_frac, samples=res.samples, total_steps=self.total_steps))
        if self._state == "warmup":
            self._set_state("training")
        if cfg.checkpoint.every and self.step % cfg.checkpoint.every == 0:
            self._save_checkpoint("periodic")
        if cfg.eval.every and self.step % cfg.eval.every == 0:
            self._evaluate()
        if self.step >= self.total_steps or self._hs_exhausted():
            self._finish()

    def _finish(self) -> None:
        self._finished = True
        self._stop.set()

    def _current_epoch(self) -> int:
        return max(self._done_batches) if self._done_batches else 0

    def _resume_position(self) -> tuple[int, list[int]]:
        """The first epoch not fully trained and the batches of it already done."""
        for epoch in sorted(self._done_batches):
            done = self._done_batches[epoch]
            if len(done) < len(self.stream.plan(epoch)):
                return epoch, sorted(done)
        nxt = max(self._done_batches) + 1 if self._done_batches else 0
        return nxt, []

    def _save_checkpoint(self, reason: str) -> None:
        if not self._replicas or self._saved_step == self.step:
            return
        cfg = self.config
        t = time.monotonic()
        rep = self._replicas[0]
        epoch, done = self._resume_position()
        self._saved_step = self.step
        path = ckpt.save_checkpoint(
            cfg.run_dir, self.step, drafter_state=rep.drafter.interchange_state(),
            drafter_config=rep.drafter.interchange_config(),
            optimizer_state=rep.optimizer.state_dict(), scheduler_state={"step": self.step},
            trainer_state={"epoch": epoch, "done": done, "total_steps": self.total_steps,
                           "rng": ckpt.capture_rng_state()},
            keep=cfg.checkpoint.keep)
        self.bus.publish(Checkpoint(step=self.step, path=str(path), seconds=time.monotonic() - t,
                                    reason=reason))

    def _evaluate(self) -> None:
        from .evaluate import evaluate_tau, target_fn_for

        cfg = self.config
        if not len(self.eval_indices) or not self._replicas or 0 not in self._targets:
            return
        prompts = []
        for i in self.eval_indices:
            ids, mask = self.dataset.get(int(i))
            resp = [j for j, m in enumerate(mask) if m]
            cut = resp[0] if resp and resp[0] > 0 else min(len(ids) - 1, cfg.eval.prompt_tokens)
            prompts.append([int(x) for x in ids[: min(cut, cfg.eval.prompt_tokens)]])
        drafter = self._replicas[0].drafter
        was_training = drafter.training
        drafter.eval()
        try:
            res = evaluate_tau(target_fn_for(self._targets[0], self.layer_ids), drafter, prompts,
                               cfg.eval.max_new_tokens, self.layer_ids)
        finally:
            drafter.train(was_training)
        self.bus.publish(EvalResult(step=self.step, tau=res.tau,
                                    acceptance=list(res.acceptance), prompts=len(prompts)))

    # -- teardown ------------------------------------------------------------------------------
    def _join_workers(self) -> list[str]:
        """Close the prefetchers and join every worker; returns the names still running."""
        t0 = time.monotonic()
        for pf in self._prefetchers:
            pf.close(timeout=JOIN_TIMEOUT_S)
        warned = False
        while True:
            alive = [t for t in self._threads if t.is_alive()]
            waited = time.monotonic() - t0
            if not alive or waited >= GIVE_UP_S:
                break
            if waited >= JOIN_TIMEOUT_S and not warned:
                warned = True
                self.bus.publish(Log(level="warning", source="engine", message=(
                    f"waiting for {[t.name for t in alive]} to finish their current GPU call "
                    f"(up to {GIVE_UP_S:.0f} s)")))
            alive[0].join(min(POLL_S, GIVE_UP_S - waited))
        stuck = [t.name for t in self._threads if t.is_alive()]
        if stuck:
            self.bus.publish(Log(level="warning", source="engine", message=(
                f"threads still running after {GIVE_UP_S:.0f} s: {stuck}")))
        return stuck

    def _teardown(self, t0: float) -> None:
        self._early = None
        self._stop.set()
        stuck = self._join_workers()
        failed = self._failure is not None
        status = "failed" if failed else ("finished" if self._finished and not self._abort_requested
                                          else "aborted")
        busy_drafters = [n for n in stuck if n.startswith("drafter")]
        if busy_drafters and not failed and self.step > 0:
            self.bus.publish(Log(level="warning", source="engine", message=(
                f"no {'final' if self._finished else 'abort'} checkpoint: {busy_drafters} still "
                f"running after {GIVE_UP_S:.0f} s could be changing the weights; the last "
                f"periodic checkpoint stands")))
        if not failed and self._replicas and self.step > 0 and not busy_drafters:
            try:
                if status == "finished" or self.config.checkpoint.on_abort:
                    self._save_checkpoint("final" if status == "finished" else "abort")
                if status == "finished" and self.config.data.eval_prompts:
                    self._evaluate()
            except BaseException as exc:  # noqa: BLE001
                self._fail(error_event(exc, source="engine", role="engine", device="",
                                       phase="teardown"))
                status = "failed"
        # Free the run's memory before anything else can start.
        self._targets.clear()
        self._replicas = []
        self._prefetchers = []
        self.hs_queue = None
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        reason = self._failure.message if self._failure is not None else ""
        self.final_status = status
        self._set_state(status, reason)
        self.bus.publish(RunEnded(status=status, step=self.step,
                                  seconds=time.monotonic() - t0, reason=reason))
        self.bus.drain(timeout=5.0)
        self._detach_sinks()
