"""Scripted event streams with fixed timestamps: the states the dashboard must show, replayable by
ReplayController (tests, snapshots) and deterministic (no wall clock anywhere)."""

from __future__ import annotations

import math

from dflash_core.observe import events as ev
from dflash_tui.state.dashboard import DashboardState

T0 = 1_750_000_000.0  # fixed start; every ts below is T0 + seconds
GIB = 1024**3
TARGETS = [f"cuda:{i}" for i in range(7)]  # the real node: targets on 0-6, drafter on 7
DRAFTERS = ["cuda:7"]
OOM_TRACEBACK = """Traceback (most recent call last):
  File "dflash_core/engine.py", line 412, in _target_loop
    feats = self.target.features(batch)
  File "dflash_core/target.py", line 188, in features
    out = layer(hidden, position_embeddings=pos)
torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 29.61 GiB. GPU 3 has a total capacity of 139.81 GiB of which 12.02 GiB is free.
"""


def start(t: float = 0.0, targets=TARGETS, drafters=DRAFTERS) -> list[ev.Event]:
    return [
        ev.RunStarted(run_name="qwen36-dflash", run_dir="runs/qwen36-dflash", config={},
                      targets=list(targets), drafters=list(drafters), total_steps=6000, ts=T0 + t),
        ev.StateChanged(state="preflight", previous="idle", ts=T0 + t),
        ev.SinkStatus(sink="wandb", status="ok", detail="runs/qwen36-dflash/wandb/offline-run-1",
                      ts=T0 + t + 1),
        ev.MemoryPlan(rows=[{"device": d, "role": "target", "components": {}, "total": 71 * GIB,
                             "free": 139 * GIB, "fits": True} for d in targets]
                      + [{"device": d, "role": "drafter", "components": {}, "total": 96 * GIB,
                          "free": 139 * GIB, "fits": True} for d in drafters], ts=T0 + t + 1),
        ev.StateChanged(state="loading", previous="preflight", ts=T0 + t + 2),
    ]


def gpu_samples(t: float, used: float, util: float, n_targets: int = 7) -> list[ev.Event]:
    out: list[ev.Event] = []
    for i in range(n_targets + 1):
        drafter = i == n_targets
        out.append(ev.GpuSample(
            index=i, name="NVIDIA H200", mem_used=int((used + 20 * drafter) * GIB),
            mem_total=int(139.8 * GIB), util=util, temperature=40 + util / 3 + i,
            torch_allocated=int((used - 4 + 20 * drafter) * GIB), ts=T0 + t))
    out.append(ev.HostSample(ram_used=180 * GIB, ram_total=2015 * GIB, cpu_percent=12.0,
                             process_rss=31 * GIB, ts=T0 + t))
    return out


def loading() -> list[ev.Event]:
    out = start() + gpu_samples(5, used=20, util=3)
    for i in range(7):
        worker, dev = f"target-{i}", f"cuda:{i}"
        out.append(ev.WorkerStatus(worker=worker, role="target", device=dev,
                                   status=ev.WORKER_LOADING, ts=T0 + 3))
        done = i == 0
        frac = 1.0 if done else 0.9 - i * 0.12
        out.append(ev.LoadProgress(worker=worker, device=dev, bytes_loaded=int(frac * 54 * GIB),
                                   bytes_total=54 * GIB, shards_loaded=round(frac * 12),
                                   shards_total=12, seconds=60 + i, done=done,
                                   memory_after=int(54.2 * GIB) if done else 0, ts=T0 + 62))
    out.append(ev.WorkerStatus(worker="target-0", role="target", device="cuda:0",
                               status=ev.WORKER_WARMUP, detail="first forward: compiling kernels", ts=T0 + 63))
    out.append(ev.Log(level="info", source="target-0", message="loaded 54.2 GiB in 60 s",
                      ts=T0 + 62))
    return out


def training(steps: int = 60, wait: float = 0.05, blocked: float = 0.71) -> list[ev.Event]:
    out = loading()
    for i in range(7):
        worker, dev = f"target-{i}", f"cuda:{i}"
        out.append(ev.LoadProgress(worker=worker, device=dev, bytes_loaded=54 * GIB,
                                   bytes_total=54 * GIB, shards_loaded=12, shards_total=12,
                                   seconds=90, done=True, memory_after=int(54.2 * GIB),
                                   ts=T0 + 90))
        out.append(ev.WorkerStatus(worker=worker, role="target", device=dev,
                                   status=ev.WORKER_WARMUP, ts=T0 + 91))
    out.append(ev.StateChanged(state="warmup", previous="loading", ts=T0 + 91))
    out.append(plan(ts=T0 + 91))
    out.append(ev.StateChanged(state="training", previous="warmup", ts=T0 + 120))
    t = 120.0
    for s in range(1, steps + 1):
        t += 2.0
        for q in range(7):
            out.append(ev.QueueDepth(name=ev.prefetch_queue(q), depth=(s + q) % 5, capacity=4,
                                     ts=T0 + t))
        out.append(ev.QueueDepth(name=ev.HS_QUEUE, depth=min(8, s // 4), capacity=8, ts=T0 + t))
        if s % 10 == 0:
            for i in range(7):
                out.append(ev.TargetMetrics(worker=f"target-{i}", device=f"cuda:{i}", batches=s * 2,
                                            tokens_per_s=31_000 - 300 * i, blocked_frac=blocked,
                                            starved_frac=0.01, ts=T0 + t))
            out += gpu_samples(t, used=74, util=97)
        loss = 6.0 * math.exp(-s / 25) + 1.2 + 0.15 * math.sin(s)
        out.append(ev.StepMetrics(step=s, epoch=0, loss=loss, lr=6e-4 * min(1, s / 20),
                                  grad_norm=0.9 + 0.1 * math.cos(s), tokens_per_s=52_000,
                                  samples_per_s=3.7, tau_tf=1.5 + s / 40, drafter_wait_frac=wait,
                                  target_blocked_frac=blocked, padding_frac=0.06, samples=8,
                                  ts=T0 + t))
    out.append(ev.EvalResult(step=steps, tau=2.87, acceptance=[1, 2, 3], prompts=8,
                             tau_tf_target=2.95, tau_tf_target_all=3.61, tau_tf_heldout=3.58,
                             tau_tf_train=3.74, agreement=0.98, agreement_positions=512,
                             ts=T0 + t))
    out.append(ev.Checkpoint(step=steps, path=f"runs/qwen36-dflash/ckpt/step-{steps}", seconds=4.2,
                             ts=T0 + t))
    return out


def plan(start_step: int = 0, total: int = 6000, ts: float = T0, **kw) -> ev.TrainingPlan:
    """Training's plan: 3 epochs of the data make 6000 steps (no max_steps)."""
    return ev.TrainingPlan(**{"start_step": start_step, "total_steps": total, "epochs": 3,
                              "epoch_steps": 6000, "targets": 7, "drafters": 1, "ts": ts, **kw})


def oom_error(t: float) -> ev.Error:
    return ev.Error(error_kind="oom", source="target-3", device="cuda:3", phase="training",
                    message="torch.OutOfMemoryError: CUDA out of memory. Tried to allocate "
                            "29.61 GiB",
                    traceback=OOM_TRACEBACK,
                    hint="lower data.token_budget in config.yaml (65536 -> 32768)", ts=T0 + t)


def failed() -> list[ev.Event]:
    out = training()
    t = out[-1].ts - T0 + 1
    return out + [
        oom_error(t),
        ev.StateChanged(state="failed", previous="training", reason="target-3: out of memory",
                        ts=T0 + t),
        ev.RunEnded(status="failed", step=60, seconds=t, reason="target-3: out of memory",
                    ts=T0 + t + 1),
    ]


def aborted() -> list[ev.Event]:
    out = training()
    t = out[-1].ts - T0 + 1
    return out + [
        ev.Log(level="warning", source="dashboard", message="abort requested", ts=T0 + t),
        ev.Checkpoint(step=60, path="runs/qwen36-dflash/ckpt/step-60", seconds=3.9,
                      reason="abort", ts=T0 + t + 4),
    ] + [  # every worker's last word, as the engine publishes it before the run's end
        ev.WorkerStatus(worker=w, role=w.split("-")[0], device=d, status=ev.WORKER_STOPPED,
                        ts=T0 + t + 4)
        for w, d in [(f"target-{i}", f"cuda:{i}") for i in range(7)] + [("drafter-0", "cuda:7")]
    ] + [
        ev.StateChanged(state="aborted", previous="training", reason="operator", ts=T0 + t + 5),
        ev.RunEnded(status="aborted", step=60, seconds=t + 5, reason="operator", ts=T0 + t + 5),
    ]


def node_2_6(steps: int = 20) -> list[ev.Event]:
    """The shipped layout: two targets feed six data-parallel drafters, training; drafter GPU 7
    is near its rehearsed 95 GiB limit with allocator retries."""
    targets, drafters = [f"cuda:{i}" for i in range(2)], [f"cuda:{i}" for i in range(2, 8)]
    out = start(targets=targets, drafters=drafters)
    out.append(ev.StateChanged(state="warmup", previous="loading", ts=T0 + 60))
    out.append(ev.StateChanged(state="training", previous="warmup", ts=T0 + 90))
    t = 90.0
    for s in range(1, steps + 1):
        t += 3.0
        out.append(ev.StepMetrics(step=s, epoch=0, loss=5.0 - s / 10, lr=6e-4, grad_norm=1.0,
                                  tokens_per_s=40_000, samples_per_s=11.2, tau_tf=2.0,
                                  drafter_wait_frac=0.05, target_blocked_frac=0.3,
                                  padding_frac=0.02, samples=34, ts=T0 + t))
    for i in range(8):
        drafter = i >= 2
        used = 90.9 + (i == 7) * 2.5 if drafter else 82.7
        out.append(ev.GpuSample(
            index=i, name="NVIDIA H200", mem_used=int(used * GIB), mem_total=int(139.8 * GIB),
            util=67.0 if drafter else 50.0, temperature=45.0 + i,
            torch_allocated=int((used - 4.5) * GIB), torch_reserved=int((used - 1.8) * GIB),
            limit=95 * GIB, alloc_retries=3 if i == 7 else 0, ts=T0 + t))
    for i in range(6):  # where each drafter's time went: mostly computing, a little waiting
        out.append(ev.DrafterMetrics(worker=f"drafter-{i}", device=f"cuda:{i + 2}", steps=1,
                                     waiting_frac=0.04, compute_frac=0.82,
                                     barrier_frac=0.08 if i else 0.02,
                                     step_frac=0.0 if i else 0.06, ts=T0 + t))
    out.append(ev.HostSample(ram_used=180 * GIB, ram_total=2015 * GIB, cpu_percent=40.0,
                             process_rss=31 * GIB, ts=T0 + t))
    return out


def two_nodes(steps: int = 20) -> list[ev.Event]:
    """node_2_6 on node 0 of two (torchrun): both nodes' summaries, node 1 a step behind with a
    warning in its last error."""
    out = node_2_6(steps)
    t = out[-1].ts - T0
    for k in (0, 1):
        out.append(ev.NodeStatus(
            node=k, host=f"gpu-node-{k}", step=steps - k, samples_per_s=11.2 - k * 0.4,
            tokens_per_s=40_000, hs_depth=3 + k, hs_capacity=8, prefetch=[[4, 4], [3, 4]],
            gpu_mem=[int(86 * GIB)] * 8,
            error="drafter-3: out of memory at micro_block_tokens 8192, now 4096" if k else "",
            ts=T0 + t))
    return out


def failed_preflight() -> list[ev.Event]:
    """A config refused by preflight: no RunStarted, no worker, one fatal config error."""
    message = "ConfigError: layout.device: cuda requested but no CUDA device is visible"
    return [
        ev.StateChanged(state="preflight", previous="idle", ts=T0),
        ev.Error(error_kind="config", source="engine", phase="preflight", fatal=True,
                 message=message, hint="set layout.device: cpu, or check CUDA_VISIBLE_DEVICES",
                 ts=T0 + 0.1),
        ev.StateChanged(state="failed", previous="preflight", reason=message, ts=T0 + 0.8),
        ev.RunEnded(status="failed", step=0, seconds=0.8, reason=message, ts=T0 + 0.8),
    ]


def checkpoint_writing() -> list[ev.Event]:
    """Training, a periodic checkpoint of step 60 a third written in the background."""
    out = [e for e in training() if not isinstance(e, ev.Checkpoint)]
    return out + [ev.CheckpointProgress(step=60, bytes_written=int(12.3 * GIB),
                                        bytes_total=int(40.1 * GIB), seconds=5.9,
                                        ts=out[-1].ts + 6)]


def resumed_at_the_end() -> list[ev.Event]:
    """A finished run restarted (r, y): it resumes from its final checkpoint, step 512 of 512
    (8 epochs; --max-steps 100000 past them), and finishes again at once."""
    cfg = dict(run_name="demo", run_dir="runs/demo", config={}, targets=["cpu:0"],
               drafters=["cpu:0"])
    return [
        ev.StateChanged(state="preflight", previous="finished", reason="restart", ts=T0),
        ev.RunStarted(**cfg, resume=True, ts=T0 + 0.1),
        ev.Log(level="info", source="engine", message="resuming from runs/demo/checkpoints/"
               "step-512 (step 512)", ts=T0 + 0.5),
        ev.StateChanged(state="loading", previous="preflight", ts=T0 + 0.6),
        ev.StateChanged(state="warmup", previous="loading", ts=T0 + 1.0),
        ev.TrainingPlan(start_step=512, total_steps=512, epochs=8, epoch_steps=512,
                        max_steps=100000, max_steps_from="--max-steps", targets=1, drafters=1,
                        ts=T0 + 1.0),
        ev.StateChanged(state="finished", previous="warmup", ts=T0 + 1.2),
        ev.RunEnded(status="finished", step=512, seconds=1.2, ts=T0 + 1.2),
    ]


def evaluated(steps: int = 120) -> list[ev.Event]:
    """Training after an evaluation of 16-token blocks: a loss that started at ~39 (the range
    needs room) and how often each of 15 positions was accepted (a long line)."""
    out = []
    for e in training(steps=steps):
        if isinstance(e, ev.StepMetrics) and e.step == 1:
            e = ev.StepMetrics(**{**e.__dict__, "loss": 39.012})
        if isinstance(e, ev.EvalResult):
            e = ev.EvalResult(step=steps, tau=3.41, prompts=8, ts=e.ts,
                              acceptance=[5, 9, 12, 11, 9, 8, 7, 6, 5, 4, 3, 3, 2, 2, 1, 1])
        out.append(e)
    return out


def fold(events: list[ev.Event]) -> DashboardState:
    """A dashboard state that has seen ``events`` (no Textual: the fold alone)."""
    s = DashboardState()
    s.apply_all(events)
    return s


def rank_labels(devices: list[str], copy: int = 0) -> list[str]:
    """The device column of each rank of a target group over ``devices``, as the engine writes
    it (TargetGroup.label: 'cuda:0 copy 0 rank 0/2')."""
    import torch
    from types import SimpleNamespace

    from dflash_core.target_group.group import TargetGroup
    from dflash_core.target_group.split import SHARDED, GroupSplit

    group = SimpleNamespace(index=copy, devices=[torch.device(d) for d in devices],
                            split=GroupSplit(len(devices), SHARDED, False))
    group.gpu_label = lambda rank: TargetGroup.gpu_label(group, rank)
    return [TargetGroup.label(group, r) for r in range(len(devices))]


def split_target_loading(cpu: bool = False) -> list[ev.Event]:
    """A target split over two ranks (target.gpus_per_copy 2, sharded: each rank its own batch
    stream, so its own row) loading its shards; the drafters on GPUs 2 and 3. ``cpu``: the
    demo's layout on the CPU (layout.targets [0, 1]), ranks 'cpu:0.0' and 'cpu:0.1'."""
    if cpu:
        labels, drafters = rank_labels(["cpu", "cpu"]), ["cpu:0"]
        targets = ["cpu:0", "cpu:1"]
    else:
        labels, drafters = rank_labels(["cuda:0", "cuda:1"]), ["cuda:2", "cuda:3"]
        targets = ["cuda:0", "cuda:1"]
    out = [e for e in start(targets=targets, drafters=drafters)
           if not isinstance(e, ev.MemoryPlan)]
    if not cpu:  # a rank's share of a 61 GiB target, and the drafters, on 80 GB cards
        out.append(ev.MemoryPlan(rows=[
            {"device": d, "role": role, "components": {}, "total": int(total * GIB),
             "free": int(79 * GIB), "fits": True}
            for d, role, total in [("cuda:0", "target", 33.5), ("cuda:1", "target", 33.5),
                                   ("cuda:2", "drafter", 76.0), ("cuda:3", "drafter", 76.0)]],
            ts=T0 + 1))
    for rank, label in enumerate(labels):
        worker = f"target-{rank}"
        out.append(ev.WorkerStatus(worker=worker, role="target", device=label,
                                   status=ev.WORKER_LOADING, ts=T0 + 3))
        out.append(ev.LoadProgress(worker=worker, device=label,
                                   bytes_loaded=int((17.5 - 6 * rank) * GIB),
                                   bytes_total=int(30.5 * GIB), shards_loaded=9 - 3 * rank,
                                   shards_total=16, seconds=41.0 + rank, ts=T0 + 44))
    for i, d in enumerate(drafters):
        out.append(ev.WorkerStatus(worker=f"drafter-{i}", role="drafter", device=d,
                                   status=ev.WORKER_WARMUP, detail="waiting for the targets",
                                   ts=T0 + 3))
    if not cpu:
        out += [ev.GpuSample(index=i, name="NVIDIA H100 80GB HBM3", mem_used=int(used * GIB),
                             mem_total=int(79.6 * GIB), util=util, temperature=38.0 + i,
                             torch_allocated=int(max(0.0, used - 0.6) * GIB), ts=T0 + 44)
                for i, (used, util) in enumerate([(18.1, 4.0), (12.0, 3.0), (2.1, 0.0),
                                                  (2.1, 0.0)])]
    out.append(ev.HostSample(ram_used=61 * GIB, ram_total=1007 * GIB, cpu_percent=23.0,
                             process_rss=9 * GIB, ts=T0 + 44))
    return out


def split_target(steps: int = 40, cpu: bool = False) -> list[ev.Event]:
    """split_target_loading's run training: both ranks stream features (the drafters wait a
    little on them), the two drafters near their limit."""
    out = split_target_loading(cpu)
    labels = [e.device for e in out if isinstance(e, ev.WorkerStatus) and e.role == "target"]
    drafters = [e.device for e in out if isinstance(e, ev.WorkerStatus) and e.role == "drafter"]
    for rank, label in enumerate(labels):
        out.append(ev.LoadProgress(worker=f"target-{rank}", device=label,
                                   bytes_loaded=int(30.5 * GIB), bytes_total=int(30.5 * GIB),
                                   shards_loaded=16, shards_total=16, seconds=78.0, done=True,
                                   memory_after=int(30.9 * GIB), ts=T0 + 80))
        out.append(ev.WorkerStatus(worker=f"target-{rank}", role="target", device=label,
                                   status=ev.WORKER_WARMUP, detail="first forward", ts=T0 + 80))
    out.append(ev.StateChanged(state="warmup", previous="loading", ts=T0 + 80))
    out.append(plan(total=1200, targets=2, drafters=len(drafters), epoch_steps=1200,
                     ts=T0 + 81))
    out.append(ev.StateChanged(state="training", previous="warmup", ts=T0 + 95))
    t = 95.0
    for s in range(1, steps + 1):
        t += 1.5
        for q in range(2):
            out.append(ev.QueueDepth(name=ev.prefetch_queue(q), depth=(s + q) % 5, capacity=4,
                                     ts=T0 + t))
        out.append(ev.QueueDepth(name=ev.HS_QUEUE, depth=s % 3, capacity=8, ts=T0 + t))
        out.append(ev.StepMetrics(step=s, epoch=0, loss=4.0 * math.exp(-s / 15) + 1.6,
                                  lr=3e-4, grad_norm=0.62, tokens_per_s=18_400,
                                  samples_per_s=24.95, tau_tf=2.1 + s / 50,
                                  drafter_wait_frac=0.31, target_blocked_frac=0.04,
                                  padding_frac=0.03, samples=32, ts=T0 + t))
    for rank, label in enumerate(labels):
        out.append(ev.TargetMetrics(worker=f"target-{rank}", device=label, batches=161 + rank,
                                    tokens_per_s=9_300 - 150 * rank, blocked_frac=0.04,
                                    starved_frac=0.27 + 0.02 * rank, ts=T0 + t))
    for i, d in enumerate(drafters):
        out.append(ev.DrafterMetrics(worker=f"drafter-{i}", device=d, steps=steps,
                                     waiting_frac=0.31, compute_frac=0.63, barrier_frac=0.05,
                                     step_frac=0.01, ts=T0 + t))
    if not cpu:
        out += [ev.GpuSample(index=i, name="NVIDIA H100 80GB HBM3", mem_used=int(used * GIB),
                             mem_total=int(79.6 * GIB), util=util, temperature=52.0 + i,
                             torch_allocated=int((used - 1.1) * GIB), ts=T0 + t)
                for i, (used, util) in enumerate([(44.2, 71.0), (41.9, 69.0), (73.8, 96.0),
                                                  (74.6, 97.0)])]
    out.append(ev.HostSample(ram_used=64 * GIB, ram_total=1007 * GIB, cpu_percent=31.0,
                             process_rss=10 * GIB, ts=T0 + t))
    return out


def split_target_finished(cpu: bool = False) -> list[ev.Event]:
    """split_target's run at its last step: each worker's last word, then the end."""
    out = split_target(cpu=cpu)
    t = out[-1].ts + 2
    labels = {e.worker: e.device for e in out if isinstance(e, ev.WorkerStatus)}
    out += [ev.WorkerStatus(worker=w, role=w.split("-")[0], device=d, status=ev.WORKER_STOPPED,
                            ts=t) for w, d in labels.items()]
    return out + [
        ev.StateChanged(state="finished", previous="training", ts=t + 1),
        ev.RunEnded(status="finished", step=40, seconds=t + 1 - T0, ts=t + 1),
    ]
