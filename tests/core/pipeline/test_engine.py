"""The engine end to end on CPU: lifecycle, records in the run folder, resume, data parallel,
config errors and the restart that follows fixing them."""

import math
import threading

import numpy as np
import pytest
import torch

from dflash_core.checkpoint import save_load as ckpt
from dflash_core.checkpoint.folders import checkpoint_step, latest_checkpoint, read_best
from dflash_core.config import ConfigError, config_from_dict, load_config
from dflash_core.pipeline.engine import Engine
from dflash_core.observe.events import (
    Checkpoint, DrafterMetrics, Error, LoadProgress, Log, RunEnded, StepMetrics, WorkerStatus,
)
from dflash_core.observe.event_log import read_events
from dflash_core.models.training.replica import DrafterReplica

from ..engine_fixtures import (  # noqa: F401 - assets is a fixture
    Recorder, assets, make_config, run_to_end, wait_no_engine_threads, write_config,
)

LIFECYCLE = ["preflight", "loading", "warmup", "training", "finished"]


def record_batches(monkeypatch) -> list[list[int]]:
    """Sample indices of every batch a drafter trains on, in order."""
    seen: list[list[int]] = []
    original = DrafterReplica.accumulate

    def accumulate(self, batch, features, seed, **kwargs):
        seen.append([int(i) for i in batch.indices])
        return original(self, batch, features, seed, **kwargs)

    monkeypatch.setattr(DrafterReplica, "accumulate", accumulate)
    return seen


def drafter_weights(step_dir) -> dict[str, torch.Tensor]:
    return ckpt.load_checkpoint(step_dir).drafter_state


# --------------------------------------------------------------------------------------------
# One run, start to finish
# --------------------------------------------------------------------------------------------

def test_run_finishes_with_its_records(tmp_path, assets):
    target, data = assets
    # warmup_frac 1/3 of 6 steps = 2 warmup steps, then 4 cosine steps
    cfg = make_config(tmp_path, target, data, optim__warmup_frac=1 / 3)
    engine = Engine(cfg)
    delivered = []  # what a bus subscriber (like the jsonl sink) receives
    engine.bus.subscribe("test", delivered.append)
    rec = run_to_end(engine)
    engine.shutdown()

    assert rec.states() == LIFECYCLE
    assert engine.state == "finished" and engine.final_status == "finished"

    steps = rec.of(StepMetrics)
    assert [m.step for m in steps] == [1, 2, 3, 4, 5, 6]
    assert all(math.isfinite(m.loss) and m.loss > 0 for m in steps)
    assert all(math.isfinite(m.grad_norm) for m in steps)
    lr = cfg.optim.lr
    expected = [lr * 0.5, lr, lr] + [lr * 0.5 * (1 + math.cos(math.pi * k / 4)) for k in (1, 2, 3)]
    assert [m.lr for m in steps] == pytest.approx(expected, rel=1e-6)
    assert steps[-1].lr < steps[3].lr < steps[2].lr  # decays after warmup

    # The bus's last word is RunEnded, and it agrees with the state.
    assert isinstance(rec.events[-1], RunEnded)
    assert rec.events[-1].status == "finished" and rec.events[-1].step == 6

    run_dir = cfg.run_dir
    # events.jsonl replays to what the bus delivered, in the same order.
    replay = read_events(run_dir / "events.jsonl")
    assert [e.kind for e in replay] == [e.kind for e in delivered]
    assert [e.ts for e in replay] == [e.ts for e in delivered]
    assert replay[0].kind == "StateChanged" and replay[0].state == "preflight"
    assert isinstance(replay[-1], RunEnded)

    log = (run_dir / "train.log").read_text()
    assert "-> finished" in log.splitlines()[-2] + log.splitlines()[-1]
    assert "step 1 " in log

    resolved = load_config(run_dir / "config.yaml")
    assert resolved.to_dict() == cfg.to_dict()

    saved = rec.of(Checkpoint)
    # the end's evaluation is the only one, so it makes the last checkpoint the best
    assert [(c.step, c.reason) for c in saved] == [(3, "periodic"), (6, "periodic"), (6, "best")]
    assert read_best(run_dir) == {"step": 6, "path": "step-6", "tau": saved[-1].tau,
                                "prompt_set": ""}
    for step in (3, 6):
        folder = run_dir / "checkpoints" / f"step-{step}"
        # the top level is the served folder; the training state in its subfolder
        assert {p.name for p in folder.iterdir()} == {"config.json", "model.safetensors",
                                                     "checksums.json", "training_state"}
        assert (folder / "training_state" / "training_state.json").is_file()
        assert ckpt.load_checkpoint(folder).step == step
    assert wait_no_engine_threads() == []


# --------------------------------------------------------------------------------------------
# Resume
# --------------------------------------------------------------------------------------------

def test_resume_trains_the_batches_an_uninterrupted_run_trains(tmp_path, assets, monkeypatch):
    target, data = assets
    seen = record_batches(monkeypatch)

    # A: six steps in one go.
    cfg_a = make_config(tmp_path / "a", target, data, data__eval_prompts=0)
    rec_a = run_to_end(Engine(cfg_a))
    assert rec_a.of(RunEnded)[0].status == "finished"
    batches_a, seen[:] = list(seen), []
    assert len(batches_a) == 6

    # B: the same run, aborted right after step 3 (the tap runs inside the step) ...
    cfg_b = make_config(tmp_path / "b", target, data, data__eval_prompts=0)
    first = Engine(cfg_b)
    first.bus.tap(lambda ev: first.abort() if isinstance(ev, StepMetrics) and ev.step == 3 else None)
    rec_b1 = run_to_end(first)
    assert rec_b1.of(RunEnded)[0].status == "aborted"
    assert checkpoint_step(latest_checkpoint(cfg_b.run_dir)) == 3
    assert seen == batches_a[:3]
    seen[:] = []

    # ... then resumed by a new engine: it trains exactly A's steps 4..6.
    second = Engine(cfg_b, resume=True)
    rec_b2 = run_to_end(second)
    assert rec_b2.of(RunEnded)[0].status == "finished"
    assert [m.step for m in rec_b2.of(StepMetrics)] == [4, 5, 6]
    assert seen == batches_a[3:]
    assert [m.lr for m in rec_b2.of(StepMetrics)] == pytest.approx(
        [m.lr for m in rec_a.of(StepMetrics)][3:])

    final_a = drafter_weights(cfg_a.run_dir / "checkpoints" / "step-6")
    final_b = drafter_weights(cfg_b.run_dir / "checkpoints" / "step-6")
    assert final_a.keys() == final_b.keys()
    for name in final_a:
        torch.testing.assert_close(final_b[name], final_a[name], rtol=1e-5, atol=1e-6)
    # and the resumed run's loss picks up where the first one was
    assert [m.loss for m in rec_b2.of(StepMetrics)] == pytest.approx(
        [m.loss for m in rec_a.of(StepMetrics)][3:], rel=1e-5)


def test_resume_on_another_layout_keeps_the_checkpoints_batch_order(tmp_path, assets,
                                                                     monkeypatch):
    """Two drafters balance the epoch's batch order for two per step (data.balance_steps); a
    resume on one drafter plans that same order, so the checkpoint's data position still names
    the batches it trained: the epoch completes with no batch twice and none lost."""
    target, data = assets
    seen = record_batches(monkeypatch)
    two = make_config(tmp_path, target, data, layout__drafters=[0, 1], data__eval_prompts=0,
                      run__max_steps=2, checkpoint__every=0)
    assert run_to_end(Engine(two)).of(RunEnded)[0].status == "finished"
    first = [tuple(b) for b in seen]
    assert len(first) == 4
    assert ckpt.load_checkpoint(latest_checkpoint(two.run_dir)).trainer_state["balance"] == 2
    seen[:] = []
    one = make_config(tmp_path, target, data, layout__drafters=[0], data__eval_prompts=0,
                      run__max_steps=0, checkpoint__every=0)
    rec = run_to_end(Engine(one, resume=True))
    assert rec.of(RunEnded)[0].status == "finished"
    assert any("batches ordered for 2 per step" in m.message for m in rec.of(Log))
    second = [tuple(b) for b in seen]
    assert not set(first) & set(second)
    trained = sorted(i for b in first + second for i in b)
    assert trained == sorted(set(trained)) and len(trained) == 64  # every sample once


# --------------------------------------------------------------------------------------------
# Data parallel
# --------------------------------------------------------------------------------------------

def test_two_drafters_meet_in_each_step_with_batches_of_like_cost(tmp_path, assets, monkeypatch):
    """Half the samples short (many rows per token-budget batch: 4x the drafter work of a batch
    of long ones). Shuffled, the two drafters' batches of a step often differ and one waits for
    the other; with data.balance_steps and the hs queue handing batches out in plan order, the
    batches of each step cost the same, though two target threads fill the queue."""
    from dflash_core.data import write_shards
    from dflash_core.data.batching import drafter_cost

    from ..engine_fixtures import VOCAB
    target, _ = assets
    rng = np.random.default_rng(0)
    samples = []
    for i in range(256):
        n = int(rng.integers(10, 16)) if i % 2 else int(rng.integers(56, 64))
        samples.append({"input_ids": rng.integers(0, VOCAB - 1, n).tolist(),
                        "loss_mask": [0, 0] + [1] * (n - 2)})
    data = tmp_path / "data"
    write_shards(samples, data, samples_per_shard=128)
    costs: dict[str, list[int]] = {}
    original = DrafterReplica.accumulate

    def accumulate(self, batch, features, seed, **kwargs):
        costs.setdefault(threading.current_thread().name, []).append(
            drafter_cost(len(batch), int(batch.lengths.max()), 64, 8))
        return original(self, batch, features, seed, **kwargs)
    monkeypatch.setattr(DrafterReplica, "accumulate", accumulate)

    def working_share(balance: bool) -> float:
        costs.clear()
        cfg = make_config(tmp_path / str(balance), target, data, layout__targets=[0, 1],
                          layout__drafters=[0, 1], layout__hs_queue=4, data__eval_prompts=0,
                          data__token_budget=256, data__max_seqs_per_batch=16,
                          data__balance_steps=balance, drafter__num_anchors=8, run__max_steps=0,
                          checkpoint__every=0)
        # (a generous timeout: the two runs train 40 steps on four threads of a busy machine)
        assert run_to_end(Engine(cfg), 240).of(RunEnded)[0].status == "finished"
        a, b = (np.array(c) for c in costs.values())  # one batch per drafter per step
        assert len(a) == len(b) == 20
        return float(((a + b) / 2).sum() / np.maximum(a, b).sum())
    assert working_share(False) < 0.8
    assert working_share(True) >= 0.95


def test_engine_with_two_drafters_finishes(tmp_path, assets, monkeypatch):
    from dflash_core.pipeline import drafter_stage

    monkeypatch.setattr(drafter_stage, "METRICS_EVERY_S", 0.0)  # a report after every step
    target, data = assets
    cfg = make_config(tmp_path, target, data, layout__drafters=[0, 1], data__eval_prompts=0,
                      run__max_steps=4)
    engine = Engine(cfg)
    rec = run_to_end(engine)
    engine.shutdown()
    assert rec.states() == LIFECYCLE
    steps = rec.of(StepMetrics)
    assert [m.step for m in steps] == [1, 2, 3, 4]
    assert all(math.isfinite(m.loss) for m in steps)
    running = {w.worker for w in rec.of(WorkerStatus) if w.status == "running"}
    assert {"drafter-0", "drafter-1"} <= running
    assert not rec.of(Error)
    # Each drafter says where its time went: one of them ran each step, the other waited.
    times = rec.of(DrafterMetrics)
    assert {m.worker for m in times} == {"drafter-0", "drafter-1"}
    assert sum(m.steps for m in times) == 2 * 4
    for m in times:
        shares = (m.waiting_frac, m.compute_frac, m.barrier_frac, m.step_frac)
        assert all(0 <= f <= 1 for f in shares) and sum(shares) <= 1.05
    assert sum(m.step_frac for m in times) > 0 and sum(m.compute_frac for m in times) > 0
    assert "drafter drafter-1 cpu:1: 1 steps, waiting" in (cfg.run_dir / "train.log").read_text()
    assert wait_no_engine_threads() == []


# --------------------------------------------------------------------------------------------
# Config errors
# --------------------------------------------------------------------------------------------

def test_mistyped_key_names_its_path_and_the_allowed_keys():
    with pytest.raises(ConfigError) as info:
        config_from_dict({"data": {"token_budgte": 4096}})
    err = info.value
    assert err.key == "data.token_budgte"
    assert "data.token_budgte" in str(err)
    assert "token_budget" in str(err) and "max_seqs_per_batch" in str(err)  # allowed keys
    assert "Did you mean 'token_budget'" in str(err)
    assert err.error_kind == "config" and "data.token_budgte" in err.hint


def test_bad_config_file_fails_then_restart_after_fixing_it_finishes(tmp_path, assets):
    target, data = assets
    good = make_config(tmp_path, target, data, data__eval_prompts=0, run__max_steps=2)
    path = write_config(tmp_path / "config.yaml", good)
    text = path.read_text()
    path.write_text(text.replace("token_budget: 256", "token_budget: lots"))

    engine = Engine(config_path=path)
    rec = Recorder(engine.bus)
    engine.start()
    ended = rec.wait_ended(30)
    assert ended.status == "failed" and engine.wait(5) == "failed"
    (err,) = [e for e in rec.of(Error) if e.fatal]
    assert err.error_kind == "config"
    assert "data.token_budget" in err.message and "lots" in err.message
    assert not rec.of(LoadProgress)
    # The engine reports and waits: nothing more happens on its own.
    assert wait_no_engine_threads() == []
    assert engine.state == "failed"

    path.write_text(text)
    engine.restart()
    failed = ended
    ended = rec.wait_for(lambda e: isinstance(e, RunEnded) and e is not failed, 60)
    assert ended.status == "finished", ended.reason
    assert [m.step for m in rec.of(StepMetrics)] == [1, 2]
    engine.shutdown()
    assert wait_no_engine_threads() == []
