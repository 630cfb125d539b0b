"""The supervision of one run, on the thread the engine starts for it: its set-up (set_up.py:
everything before weights load), loading, training and teardown, walking the lifecycle from
preflight to the run's end.

Workers (a loader and a target stage per target device, a drafter stage per drafter device, a
telemetry sampler, the stall watchdog) run in the run's guarded threads (run.py): any exception
in any of them, or here, becomes an Error event, sets the run's stop flag and sends the run to
``failed``; the process never dies of it. The engine (engine.py) made the run and lends what it
keeps across runs; it asks a run to stop only through the run's stop flag.
"""

from __future__ import annotations

import functools
import gc
import json
import time
from typing import Callable

import torch

from dflash_core.config import NodesConfig, TelemetryConfig, recipe_text
from dflash_core.data import Prefetcher
from dflash_core.families.registry import family_of
from dflash_core.models.compile_guard import serialize_triton_autotuning
from dflash_core.models.training.replica import ANCHOR_PAD, prepare_batch
from dflash_core.models.training.trainer import build_replicas
from dflash_core.pipeline.step_barrier import StepBarrier
from dflash_core.observe.bus import EventBus
from dflash_core.observe.errors import error_event
from dflash_core.observe.events import Log, TrainingPlan, prefetch_queue
from dflash_core.observe.telemetry import TelemetrySampler
from dflash_core.checkpoint.data_position import DataPosition
from dflash_core.checkpoint.checkpointer import Checkpointer
from dflash_core.pipeline import host_memory
from dflash_core.pipeline.drafter_stage import DrafterStage
from dflash_core.pipeline.evaluation import Evaluator
from dflash_core.pipeline.hs_queue import HiddenStateQueue
from dflash_core.pipeline.lifecycle import Lifecycle
from dflash_core.pipeline.queue_depth import DepthReporter
from dflash_core.pipeline.run import Run
from dflash_core.pipeline.set_up import SetUp
from dflash_core.pipeline.target_stage import TargetStage
from dflash_core.pipeline.workers import POLL_S, Stopped
from dflash_core.planning.allocator import apply_card_limit
from dflash_core.planning.layout_advice import LayoutAdvisor
from dflash_core.planning.preflight import device_label
from dflash_core.models.target.shape import model_shape
from dflash_core.pipeline.group_stage import GroupStage
from dflash_core.target_group.group import TargetGroup
from dflash_core.target_group.split import SHARDED, copies, split_of
from dflash_core.units import GiB

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


class Supervisor:
    """One per run. What the engine lends it: the bus and the lifecycle (kept across runs), the
    run's set-up, and ``max_steps_from`` (which setting ends the run at run.max_steps)."""

    def __init__(self, run: Run, bus: EventBus, lifecycle: Lifecycle, set_up: SetUp, *,
                 max_steps_from: Callable[[], str]):
        self.run, self.bus, self.lifecycle, self.set_up = run, bus, lifecycle, set_up
        self.nodes = set_up.nodes
        self.max_steps_from = max_steps_from

    def supervise(self) -> None:
        run = self.run
        run.heartbeats.beat("preflight")
        try:
            self.lifecycle.enter("preflight")
            self.set_up()
            if not run.stop.is_set():
                self._load()
            if not run.stop.is_set():
                self._train()
        except Stopped:
            pass
        except BaseException as exc:  # noqa: BLE001
            run.fail(error_event(exc, source="engine", role="engine", device="",
                                 phase=self.lifecycle.state))
        finally:
            self._teardown()

    # -- loading -------------------------------------------------------------------------------
    def _load(self) -> None:
        run = self.run
        cfg, prep, publish = run.config, run.prep, self.bus.publish
        self.lifecycle.enter("loading")
        limits: dict[int, int] = {}
        for index in sorted({d.index for d in run.target_devices + run.drafter_devices
                             if d.type == "cuda"}):
            limit = apply_card_limit(torch.device("cuda", index), cfg.layout.gpu_memory_gib)
            if cfg.layout.gpu_memory_gib:
                limits[index] = limit
                publish(Log(level="info", source="engine", message=(
                    f"cuda:{index} limited to {limit / GiB:.1f} GiB (layout.gpu_memory_gib)")))
        self._start_telemetry(limits)
        groups = self._target_groups()
        # the batch streams: one per target GPU, or per rank / per copy of a target group
        world = sum(g.split.producers for g in groups) if groups else len(run.target_devices)
        if run.resume:  # its data position names batches of the order it was written with
            wrote = int(run.resume.trainer_state.get("balance", 1))
            if wrote != prep.stream.balance:
                publish(Log(level="info", source="engine", message=(
                    f"resume: batches ordered for {wrote} per step as the checkpoint's run did "
                    f"(this layout would balance {prep.stream.balance}; data.balance_steps)")))
                prep.stream.use_balance(wrote)
        run.position = DataPosition(lambda e: len(prep.stream.plan(e)), len(run.drafter_devices),
                                    run.resume.trainer_state if run.resume else None)
        # The loader threads make each batch's drafter anchors and labels (host work the
        # drafter's step would otherwise wait on); rounded as the drafter GPUs want them.
        for_drafter = functools.partial(
            prepare_batch, num_anchors=cfg.drafter.num_anchors,
            block_size=family_of(cfg).label_width(cfg.drafter), seed=cfg.run.seed,
            pad_to=ANCHOR_PAD if run.drafter_devices[0].type == "cuda" else 1,
            per_1k=cfg.drafter.anchors_per_1k_tokens)
        # Several nodes: node k's targets take global shards k*T .. k*T+T-1 of N*T.
        node, nodes = (self.nodes.rank, self.nodes.world) if self.nodes is not None else (0, 1)
        # The drafters take this node's batches in plan order, whichever target ran ahead.
        run.hs_queue = HiddenStateQueue(
            cfg.layout.hs_queue, world, publish, run.stop, beat=run.heartbeats.beat,
            order=prep.stream.positions(run.position.start_epoch, run.position.start_done,
                                        range(node * world, node * world + world),
                                        nodes * world))
        stream_devices = ([g.devices[r] for g in groups for r in range(g.split.producers)]
                          if groups else run.target_devices)
        for rank, dev in enumerate(stream_devices):
            batches = prep.stream.iter_batches(run.position.start_epoch, run.position.start_done,
                                               worker=(node * world + rank, nodes * world))
            run.prefetchers.append(Prefetcher(
                batches, cfg.data.prefetch_batches, pin=dev.type == "cuda", name=f"loader-{rank}",
                prepare=for_drafter, stop=run.stop,
                on_depth=DepthReporter(prefetch_queue(rank), publish), beat=run.heartbeats.beat))
        if any(d.type == "cuda" for d in run.target_devices):
            serialize_triton_autotuning()  # targets' (and the evaluation's) FLA kernels
        for stage in self._group_stages(groups):
            run.targets.append(stage)
            self.run.start_worker(stage.name, "target", stage.label, stage.run)
        for rank, dev in enumerate([] if groups else run.target_devices):
            label = device_label(dev, rank)
            stage = TargetStage(
                rank, dev, label, target_path=prep.target_path, dtype=cfg.target.dtype,
                attn_implementation=cfg.target.attn_implementation, layer_ids=prep.layer_ids,
                prefetcher=run.prefetchers[rank], hs_queue=run.hs_queue,
                publish=publish, stop=run.stop, heartbeats=run.heartbeats,
                last_hidden=family_of(cfg).last_hidden,
                trust_remote_code=cfg.target.trust_remote_code)
            run.targets.append(stage)
            self.run.start_worker(stage.name, "target", label, stage.run)
        for stage in run.targets:
            while not stage.loaded.is_set():
                if run.stop.wait(POLL_S):
                    raise Stopped()
                run.heartbeats.beat("waiting for the targets to load")
                run.hours_tick()

    def _target_groups(self) -> list:
        """With target.gpus_per_copy > 1: the copies of the target, their ranks started (from
        this thread, which outlives them; target_group/group.py)."""
        run = self.run
        cfg, prep = run.config, run.prep
        split = split_of(cfg.target)
        if split.k == 1:
            return []
        raw = json.loads((prep.target_path / "config.json").read_text(encoding="utf-8"))
        moe = model_shape(raw).experts > 0
        run.groups = [
            TargetGroup(i, devices, split, target_path=prep.target_path, dtype=cfg.target.dtype,
                        attn_implementation=cfg.target.attn_implementation,
                        layer_ids=prep.layer_ids, last_hidden=family_of(cfg).last_hidden,
                        trust_remote_code=cfg.target.trust_remote_code,
                        distributed=split.distributed(moe), run_dir=cfg.run_dir,
                        publish=self.bus.publish)
            for i, devices in enumerate(copies(run.target_devices, split.k))]
        for group in run.groups:
            group.start()
        return run.groups

    def _group_stages(self, groups: list) -> list:
        """The groups' batch streams as target workers: a rank each (sharded), a copy each
        (shared), numbered as the prefetchers are."""
        run = self.run
        stages = []
        for group in groups:
            owned = ([[r] for r in range(group.split.k)] if group.split.mode == SHARDED
                     else [list(range(group.split.k))])
            for ranks in owned:
                n = len(stages)
                stages.append(GroupStage(
                    n, group, ranks, prefetcher=run.prefetchers[n],
                    hs_queue=run.hs_queue, publish=self.bus.publish, stop=run.stop,
                    heartbeats=run.heartbeats))
        return stages

    def _start_telemetry(self, limits: dict[int, int]) -> None:
        run = self.run
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
        self.run.start_worker("telemetry", "telemetry", "host", sampler.run)

    # -- training ------------------------------------------------------------------------------
    def _train(self) -> None:
        run = self.run
        cfg, prep, publish = run.config, run.prep, self.bus.publish
        self.lifecycle.enter("warmup")
        run.replicas = build_replicas(cfg.drafter, cfg.optim, run.targets[0].model,
                                      run.drafter_devices, seed=cfg.run.seed,
                                      layer_ids=prep.layer_ids, mask_id=prep.mask_id,
                                      resume=run.resume,
                                      settings=family_of(cfg).settings(cfg.drafter))
        if run.resume is not None:
            run.step = run.resume.step
        # The run's two components, each with its own section of the config.
        run.checkpointer = Checkpointer(
            cfg.checkpoint, cfg.run_dir, publish, replicas=run.replicas,
            state=run.training_state, served_dtype=getattr(torch, cfg.drafter.dtype),
            optimizer=cfg.optim.name, records=run.writes_records, beat=run.heartbeats.beat,
            best_set=cfg.eval.best_set)
        run.evaluator = Evaluator(
            cfg.eval, publish, dataset=prep.dataset, eval_indices=prep.eval_indices,
            layer_ids=prep.layer_ids, max_length=cfg.data.max_length,
            loss_chunk=cfg.drafter.loss_chunk, seed=cfg.run.seed, sets=prep.eval_sets,
            served_dtype=cfg.drafter.dtype, provenance=prep.provenance)
        run.checkpointer.start(run.step)
        run.barrier = StepBarrier(len(run.replicas), run.stop)
        gpus = torch.cuda.device_count() if run.drafter_devices[0].type == "cuda" else 0
        run.advisor = LayoutAdvisor(publish, len(run.target_devices), len(run.drafter_devices),
                                    gpus)
        self.bus.tap(run.advisor)  # says once which side bounds the run and the balancing split
        run.last_step_t = time.monotonic()
        # Where it starts and which limit ends it: said once, for every reader alike.
        publish(TrainingPlan(
            start_step=run.step, total_steps=run.total_steps, epochs=cfg.optim.epochs,
            epoch_steps=prep.epoch_steps, max_steps=cfg.run.max_steps,
            max_steps_from=self.max_steps_from(),
            targets=len(run.target_devices), drafters=len(run.replicas),
            recipe=recipe_text(cfg.to_dict())))
        if run.step >= run.total_steps:
            run.finished = True
            return
        for rank, rep in enumerate(run.replicas):
            label = device_label(rep.device, rank)
            stage = DrafterStage(rank, rep, label, hs_queue=run.hs_queue, position=run.position,
                                 barrier=run.barrier, grad_accum=cfg.optim.grad_accum,
                                 seed=cfg.run.seed, on_step=run.step_once,
                                 step_of=lambda: run.step, publish=publish,
                                 stop=run.stop, heartbeats=run.heartbeats)
            self.run.start_worker(stage.name, "drafter", label, stage.run)
        while not run.stop.wait(POLL_S):
            run.heartbeats.beat("supervising training")
            run.hours_tick()

    # -- teardown ------------------------------------------------------------------------------
    def _join_workers(self) -> list[str]:
        """Close the prefetchers and join every worker; returns the names still running."""
        run = self.run
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
                # A stream can wait inside a queue's get for a rank that hangs (a CPU tensor
                # comes as a file descriptor its sender must hand over, with no timeout):
                # ending the ranks breaks that wait, and they end with the run anyway.
                if run.groups:
                    self._end_groups()
                    alive = [t for t in alive if t.is_alive()]
                    if not alive:
                        break
                self.bus.publish(Log(level="warning", source="engine", message=(
                    f"waiting for {[t.name for t in alive]} to finish their current GPU call "
                    f"(up to {GIVE_UP_S:.0f} s)")))
            alive[0].join(min(POLL_S, GIVE_UP_S - waited))
        stuck = [t.name for t in run.threads if t.is_alive()]
        if stuck:
            self.bus.publish(Log(level="warning", source="engine", message=(
                f"threads still running after {GIVE_UP_S:.0f} s: {stuck}")))
        return stuck

    def _end_groups(self) -> None:
        """Every rank of every target group ends with the run's workers (a restart starts them
        again: a rank's collectives and memory are the run's, and the new config may split the
        target otherwise)."""
        for group in self.run.groups:
            forced = group.shutdown()
            if forced:
                self.bus.publish(Log(level="warning", source=f"group-{group.index}", message=(
                    f"target group {group.index}: {', '.join(forced)} (did not stop within "
                    "the grace time)")))
        self.run.groups = []

    def _teardown(self) -> None:
        run, ck = self.run, self.run.checkpointer
        run.early = None
        run.stop.set()
        stuck = self._join_workers()
        failed = run.failure is not None
        status = "failed" if failed else ("finished" if run.finished and not run.abort_requested
                                          else "aborted")
        busy_drafters = [n for n in stuck if n.startswith("drafter")]
        if self.nodes is not None:
            # A run whose config could not be read has no link yet: it says farewell by the
            # defaults of nodes.* (the others wait for it at the start of the run).
            link = run.link or self.set_up.link(NodesConfig(), TelemetryConfig.stall_floor_s)
            link.farewell(status)
            self.bus.untap(link.note_error)
        # Another node's failure leaves this node's weights at the last step all nodes took.
        saves = not failed or run.peer_failed
        if busy_drafters and saves and run.step > 0:
            self.bus.publish(Log(level="warning", source="engine", message=(
                f"no {'final' if run.finished else 'abort'} checkpoint: {busy_drafters} still "
                f"running after {GIVE_UP_S:.0f} s could be changing the weights; the last "
                f"periodic checkpoint stands")))
        if saves and ck is not None and run.step > 0 and not busy_drafters:
            try:
                if status == "finished" or run.config.checkpoint.on_abort:
                    ck.save("final" if status == "finished" else "abort", run.step)
                evaluates = run.config.data.eval_prompts or run.config.eval.prompt_sets
                if status == "finished" and evaluates and not failed:
                    run.evaluate()
            except BaseException as exc:  # noqa: BLE001
                run.fail(error_event(exc, source="engine", role="engine", device="",
                                     phase="teardown"))
                status = "failed"
        try:
            if ck is not None:
                ck.close()  # after the last write is durable
        except BaseException as exc:  # noqa: BLE001
            run.fail(error_event(exc, source="engine", role="engine", device="",
                                 phase="teardown"))
            status = "failed"
        # the ranks of target groups end after the final evaluation, which decodes through them
        self._end_groups()
        if run.advisor is not None:
            self.bus.untap(run.advisor)
        # Free the run's memory before anything else can start.
        run.release()
        gc.collect()
        free_cuda_caches()
        host_memory.give_back()
        reason = run.failure.message if run.failure is not None else ""
        run.publish_hours("end")  # the devices are held until here
        self.lifecycle.end(status, step=run.step, seconds=time.monotonic() - run.started_at,
                           reason=reason)
        self.bus.drain(timeout=5.0)
        if run.sinks is not None:
            run.sinks.close()
            run.sinks = None
