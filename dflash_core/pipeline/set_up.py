"""A run's set-up, its preflight state: everything before tens of GB of weights load, in order:
read the config, open the run's records (the run folder, config.yaml, the sinks), announce the
run, join the other nodes, run the preflight checks (planning/preflight.py), find the checkpoint
to resume. What it learns it puts in the run (run.py): the config, the link between nodes, the
sinks, the devices, what preflight prepared, the checkpoint to resume."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Callable

import torch
from transformers.utils import logging as hf_logging

from dflash_core.config import Config, ConfigError, NodesConfig, save_config
from dflash_core.multinode.node_link import NodeLink
from dflash_core.multinode.node_failure import NodeFailure
from dflash_core.multinode.node_place import node_dir_name
from dflash_core.multinode.nodes import NodeGroup
from dflash_core.observe.bus import EventBus
from dflash_core.observe.device_hours import RECORD_KEY, Figure, figure_text
from dflash_core.observe.events import Log, RunStarted
from dflash_core.observe.sinks.run_sinks import RunSinks
from dflash_core.observe.watchdog import Watchdog
from dflash_core.persist.hours_ledger import read_held
from dflash_core.checkpoint.resume import (
    check_resume_data, check_resume_nodes, check_resume_optimizer, expected_drafter_config,
    load_for_resume,
)
from dflash_core.persist.run_folder import refuse_if_used
from dflash_core.checkpoint.checkpointer import check_checkpoints_writable, probe_writable
from dflash_core.pipeline.hours_meter import HoursMeter
from dflash_core.pipeline.run import Run
from dflash_core.pipeline.workers import Stopped
from dflash_core.planning.allocator import AllocatorSetting
from dflash_core.planning.preflight import demo_log_progress, device_label, prepare, resolve_devices


def records_dir(cfg: Config, nodes: NodeGroup | None) -> Path:
    """Where a process's records (events.jsonl, train.log, commands/) go: the run folder, or
    its node-K/ folder on several nodes."""
    return cfg.run_dir if nodes is None else cfg.run_dir / node_dir_name(nodes.rank)



class SetUp:
    """One per run, called once on the run's thread. What the engine lends it: the bus, the node
    group and the allocator's settings (kept across runs), ``resume`` (--resume, or a restart),
    ``read_config`` (the run's config: on several nodes it may wait for node 0 to name a fresh
    run folder), ``renamed`` (the run.name --new-run replaced, else None), and ``restart`` /
    ``restarting`` for the node link (another node may ask for a restart)."""

    def __init__(self, run: Run, bus: EventBus, *, nodes: NodeGroup | None,
                 allocator: AllocatorSetting, resume: bool, read_config: Callable[[], Config],
                 renamed: Callable[[], str | None], restart: Callable[[], None],
                 restarting: Callable[[], bool]):
        self.run, self.bus, self.nodes, self.allocator = run, bus, nodes, allocator
        self.resume, self.read_config, self.renamed = resume, read_config, renamed
        self.restart, self.restarting = restart, restarting

    def __call__(self) -> None:
        """The set-up, in the order this module's docstring names."""
        run = self.run
        hf_logging.disable_progress_bar()  # its bars write behind the dashboard's back
        try:
            cfg = run.config = self.read_config()
        except NodeFailure as exc:  # waiting for node 0's run folder name
            if exc.ending != "aborted":  # an abort here or on node 0 ends the run as aborted
                raise
            run.abort_requested = True
            raise Stopped() from exc
        if self.nodes is not None:
            # Made first: a run that ends before it joins still tells the others (farewell).
            run.link = self.link(cfg.nodes, cfg.telemetry.stall_floor_s)
        # Before anything else can hang: a stuck read in preflight is reported like any stall.
        watchdog = Watchdog(run.heartbeats, self.bus.publish, run.stop, cfg.telemetry.stall_floor_s)
        run.start_worker("watchdog", "watchdog", "host", watchdog.run)
        self._open_records(cfg)
        self._announce(cfg)
        if self.nodes is not None:
            # With the run's records open (a failure to join is in its events and train.log),
            # before it reads any checkpoint (a restart resumes from node 0's, written by now).
            self._join_nodes(cfg)
        self._check(cfg)
        if self.resume:
            self._find_resume(cfg)
        run.ledger_open = True  # preflight passed, the resume settled: device_hours.json may change
        if (self.resume or run.prep.fitted) and self.lead:  # config.yaml: what the run uses
            save_config(cfg, cfg.run_dir / "config.yaml")

    @property
    def lead(self) -> bool:
        """This process writes the run folder's shared files (config.yaml, checkpoints, W&B):
        on one node, or node 0 of several. Every node writes its own records in node-K/."""
        return self.nodes is None or self.nodes.rank == 0

    def link(self, nodes: NodesConfig, stall_s: float) -> NodeLink:
        link = NodeLink.from_config(nodes, stall_s, self.run, self.nodes, self.bus.publish,
                                    fail=self.run.fail, restart=self.restart,
                                    restarting=self.restarting)
        self.bus.tap(link.note_error)
        return link

    def _open_records(self, cfg: Config) -> None:
        """Make the run folder (refusing one that holds an earlier run), write the resolved
        config.yaml and attach the sinks, handing them the events published so far."""
        run = self.run
        run_dir, records = cfg.run_dir, records_dir(cfg, self.nodes)
        if not self.resume:
            # never overwrite an earlier run's records (the run folder's own: node 0's)
            if self.lead:
                self._say_reused(refuse_if_used(run_dir))
            if records != run_dir:
                self._say_reused(refuse_if_used(records))
        asked = self.renamed()
        if not self.resume and asked:
            why = (f"{Path(cfg.run.output_dir) / asked} holds an earlier run" if self.lead
                   else "the folder node 0 picked")  # on its disk, beside an earlier run
            self.bus.publish(Log(level="info", source="engine", message=(
                f"new run in {run_dir}: {why} (--new-run)")))
        try:
            records.mkdir(parents=True, exist_ok=True)
            if not self.resume and self.lead:  # a resume keeps it until its checkpoint fits
                save_config(cfg, run_dir / "config.yaml")
            elif self.resume:  # a folder there but read-only: said now as a new run's would be
                for folder in {run_dir, records} if self.lead else {records}:
                    probe_writable(folder)
            # its records (events.jsonl, train.log) opened for appending: a file there that
            # refuses it (read-only, another user's) is said as the folder's
            run.sinks = RunSinks(self.bus, cfg, records, run.early or [])
        except OSError as exc:
            raise ConfigError("run.output_dir", f"cannot write run folder {run_dir}: {exc}",
                              hint="set run.output_dir to a writable folder") from exc
        run.early = None
        if self.lead:  # with the records open: the refusal is in events.jsonl and train.log too
            check_checkpoints_writable(run_dir)

    def _say_reused(self, attempts: str) -> None:
        if attempts:
            self.bus.publish(Log(level="info", source="engine", message=(
                f"starting in {attempts}: they ended before a step, so there is no run to keep")))

    def _announce(self, cfg: Config) -> None:
        """Resolve the devices and publish RunStarted (and the allocator's settings on CUDA)."""
        run = self.run
        run.target_devices, run.drafter_devices = resolve_devices(cfg)
        # From here on the run holds its devices: their time counts from the run's start.
        run.hours = HoursMeter(run.target_devices, run.drafter_devices,
                               started_at=run.started_at,
                               nodes=self.nodes.world if self.nodes is not None else 1,
                               price=cfg.cost.gpu_hour_price, currency=cfg.cost.currency,
                               held_before=read_held(cfg.run_dir))
        cuda = any(d.type == "cuda" for d in run.target_devices + run.drafter_devices)
        self.bus.publish(RunStarted(
            run_name=cfg.run.name, run_dir=str(records_dir(cfg, self.nodes)),
            config=cfg.to_dict(),
            targets=[device_label(d, i) for i, d in enumerate(run.target_devices)],
            drafters=[device_label(d, i) for i, d in enumerate(run.drafter_devices)],
            allocator=(self.allocator.conf or "PyTorch defaults") if cuda else "",
            resume=self.resume))
        if cuda:
            self.bus.publish(Log(level="info", source="engine", message=self.allocator.describe()))

    def _check(self, cfg: Config) -> None:
        """The preflight (planning/preflight.py): every check that needs no weights, the demo's
        assets built; then W&B, whose settings it checked."""
        run = self.run

        def check_stop():  # called as the demo's assets are built: progress too
            if run.stop.is_set():
                raise Stopped()
            run.heartbeats.beat("building the demo")
        run.prep = prepare(cfg, cfg.run_dir, run.target_devices, run.drafter_devices,
                           publish=self.bus.publish,
                           demo_progress=demo_log_progress(self.bus.publish, check_stop),
                           nodes=self.nodes.world if self.nodes is not None else 1,
                           checkpoints=self.lead)
        if self.lead:  # several nodes: W&B from node 0 alone
            run.sinks.add_wandb(cfg, cfg.run_dir)

    def _find_resume(self, cfg: Config) -> None:
        """The newest intact checkpoint of this drafter's shape (None: nothing to resume)."""
        run = self.run
        expected = expected_drafter_config(cfg, run.prep.target_path, run.prep.layer_ids,
                                           run.prep.mask_id)
        # Several nodes read one folder: node 0 alone moves a damaged checkpoint aside.
        run.resume_t0 = time.monotonic()  # the time from --resume to the first step is shown
        run.resume = load_for_resume(cfg.run_dir, expected, self.bus.publish,
                                     set_aside_damaged=self.lead)
        if run.resume is not None:
            check_resume_nodes(run.resume, self.nodes.world if self.nodes else 1)
            check_resume_optimizer(run.resume, cfg)
            check_resume_data(run.resume, run.data_identity(), cfg.data.allow_changed_data,
                              self.bus.publish)
            self.bus.publish(Log(level="info", source="engine", message=(
                f"resuming from {run.resume.path} (step {run.resume.step})")))
        self._resume_hours()

    def _resume_hours(self) -> None:
        """The device time goes on from the resumed checkpoint's figure (hours_meter.py)."""
        run, meter = self.run, self.run.hours
        if meter is None:
            return
        loaded = run.resume
        if loaded is not None and not meter.resume_from(loaded.trainer_state.get(RECORD_KEY),
                                                        loaded.step):
            self.bus.publish(Log(level="info", source="engine", message=(
                f"resume: {loaded.path} records no device time (written before checkpoints "
                f"did): device-hours are counted from step {loaded.step}")))
            return
        carried, (lost_gpu, lost_host) = meter.carried, meter.lost()
        if loaded is not None or lost_gpu or lost_host:
            self.bus.publish(Log(level="info", source="engine", message=(
                "resume: device time so far " + figure_text(
                    Figure(**{**carried.record(), "price": meter.price,
                              "currency": meter.currency}), lost_gpu, lost_host))))

    def _join_nodes(self, cfg: Config) -> None:
        """Several nodes: join the others (the first run of the process) and make this run's
        side of the step protocol."""
        run, nodes = self.run, self.nodes
        if nodes.info.local_world > 1 and cfg.layout.device != "cpu":
            raise ConfigError("layout.device", f"torchrun started {nodes.info.local_world} "
                              "processes on this machine: each would use every GPU of layout.*",
                              hint="start one process per node: torchrun --nproc-per-node 1")
        link = run.link
        run.heartbeats.beat(f"joining {nodes.world} nodes")
        if not nodes.connected:
            try:
                nodes.connect(cfg.nodes.timeout_s, cuda=cfg.layout.device != "cpu"
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
            f"node {nodes.rank} of {nodes.world} ({nodes.host}); "
            f"{'writes checkpoints and W&B' if nodes.rank == 0 else 'node 0 writes checkpoints'}")))
        link.start()
        if run.stop.is_set():
            raise Stopped()
