"""What the dashboard's panels compute from its facts (state/views.py): GPU rows and their roles,
the bottleneck line, the drafters' time shares, acceptance per position and the tau gap."""

from __future__ import annotations

import pytest
import tui_scenarios as sc
from dflash_core.observe import events as ev
from dflash_tui.state.dashboard import DashboardState
from tui_scenarios import fold

GIB = sc.GIB


def test_gpu_rows_take_roles_plan_and_samples():
    s = fold(sc.start() + sc.gpu_samples(5, used=20, util=3))
    rows = s.gpu_rows()
    assert [r.index for r in rows] == list(range(8))
    assert [r.role for r in rows] == ["target"] * 7 + ["drafter"]  # from RunStarted labels
    r0, r7 = rows[0], rows[7]
    assert (r0.mem_used, r0.torch_allocated, r0.plan) == (20 * GIB, 16 * GIB, 71 * GIB)
    assert r7.plan == 96 * GIB and r7.sampled and r7.util == 3
    assert s.host is not None and s.host.ram_total == 2015 * GIB


def test_gpu_role_from_sample_wins_and_shared_gpu_is_both():
    s = fold(sc.start(targets=["cuda:0", "cuda:1"], drafters=["cuda:1"]))
    assert [r.role for r in s.gpu_rows()] == ["target", "target+drafter"]
    s.apply(ev.GpuSample(index=0, name="x", mem_used=1, mem_total=2, role="drafter", ts=sc.T0))
    assert s.gpu_rows()[0].role == "drafter"


def test_cpu_only_run_has_no_gpu_rows_but_workers():
    s = fold(sc.start(targets=["cpu:0"], drafters=["cpu:0"]) + [
        ev.WorkerStatus(worker="target-0", role="target", device="cpu", status="running",
                        ts=sc.T0 + 3),
        ev.WorkerStatus(worker="drafter-0", role="drafter", device="cpu", status="running",
                        ts=sc.T0 + 3)])
    assert s.cpu_only and s.gpu_rows() == []
    assert list(s.workers) == ["target-0", "drafter-0"]


def step(wait: float, blocked: float, s: int = 1) -> ev.StepMetrics:
    return ev.StepMetrics(step=s, epoch=0, loss=1.0, lr=1e-4, grad_norm=1.0, tokens_per_s=1.0,
                          samples_per_s=1.0, tau_tf=1.0, drafter_wait_frac=wait,
                          target_blocked_frac=blocked, ts=sc.T0 + s)


def test_bottleneck_line():
    s = DashboardState()
    assert s.bottleneck() == ""  # nothing flows yet
    s.apply(step(wait=0.02, blocked=0.71))
    assert s.bottleneck() == "drafter-bound: targets blocked 71% of the time"
    s.apply(step(wait=0.40, blocked=0.0))
    assert s.bottleneck() == "target-bound: drafter waited 40% of the time"
    s.apply(step(wait=0.05, blocked=0.1))
    assert s.bottleneck() == "balanced"
    # targets' own blocked share counts when the step does not carry it
    s.apply(ev.TargetMetrics(worker="target-0", device="cuda:0", batches=1, tokens_per_s=1.0,
                             blocked_frac=0.5, ts=sc.T0 + 9))
    assert s.bottleneck() == "drafter-bound: targets blocked 50% of the time"
    # drafter waits because the targets wait on data: say so
    s.apply(ev.TargetMetrics(worker="target-0", device="cuda:0", batches=2, tokens_per_s=1.0,
                             blocked_frac=0.0, starved_frac=0.6, ts=sc.T0 + 10))
    s.apply(step(wait=0.5, blocked=0.0))
    assert s.bottleneck().startswith("data-bound: targets starved 60% of the time")


def test_acceptance_per_position_the_tau_gap_and_the_best_checkpoint():
    s = fold(sc.training(steps=20))  # ends with an evaluation: acceptance [1, 2, 3], tau 2.87
    # rounds that accepted >= 1 drafted token: 5 of 6; >= 2: 3 of 6
    assert s.accepted_by_position() == pytest.approx([5 / 6, 3 / 6])
    step, tau, tf = s.eval_history[-1]
    assert (step, tau) == (20, 2.87) and tf == pytest.approx(s.step.tau_tf)
    # the mismatch gap: teacher-forced on the decoded text minus exact
    assert s.tau_gap == pytest.approx(2.95 - 2.87)
    assert "step 20 on 8 prompts: tau exact 2.87 | tf target 2.95" in s.log[-2].text
    # an older run's evaluation (no teacher-forced tau of its own): the step's, as before
    s.apply(ev.EvalResult(step=21, tau=2.0, acceptance=[1], prompts=8, ts=sc.T0 + 400))
    assert s.tau_gap == pytest.approx(s.step.tau_tf - 2.0)
    s.apply(ev.Checkpoint(step=20, path="runs/x/checkpoints/step-20", seconds=0.0, reason="best",
                          tau=2.87, ts=sc.T0 + 500))
    assert s.best.step == 20 and "best so far: step 20 (tau 2.87)" in s.log[-1].text


def test_drafter_time_shares_average_over_drafters():
    s = fold(sc.start())
    assert s.drafter_shares() is None
    dirty = s.apply(ev.DrafterMetrics(worker="drafter-0", device="cuda:7", steps=2,
                                      waiting_frac=0.1, compute_frac=0.7, barrier_frac=0.0,
                                      step_frac=0.2))
    assert "training" in dirty
    s.apply(ev.DrafterMetrics(worker="drafter-1", device="cuda:6", steps=2, waiting_frac=0.3,
                              compute_frac=0.5, barrier_frac=0.2, step_frac=0.0))
    s.apply(ev.DrafterMetrics(worker="drafter-1", device="cuda:6", steps=2, waiting_frac=0.5,
                              compute_frac=0.3, barrier_frac=0.2, step_frac=0.0))
    assert s.drafter_shares() == pytest.approx(
        {"waiting": 0.3, "compute": 0.5, "barrier": 0.1, "step": 0.1})
