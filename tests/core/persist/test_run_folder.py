"""A run folder is never overwritten, and a resume loads only an intact checkpoint of the model
the config describes (docs/bad-input.md, "Run folder and resume").

| input                                              | what happens                               |
|----------------------------------------------------|--------------------------------------------|
| same run.name again, no --resume                   | [config] run.name: folder holds a run; hint |
|                                                    | --resume / new run.name / --new-run        |
| same run.name again, --new-run                     | starts in <name>-2, says so                |
| --resume, config has other layers / block size     | [config] drafter.num_layers: each key,     |
|                                                    | config and checkpoint values               |
| --resume, no checkpoint                            | warning "nothing to resume", step 0        |
| --resume, newest checkpoint truncated              | warning names it, moved to damaged-step-N, |
|                                                    | resumes from the older intact one          |
| --resume, every checkpoint damaged                 | [io] names each; nothing deleted           |
| --resume, config has another optim.name            | [config] optim.name: both names; hint      |
| refused by preflight, then the fixed config again  | starts in the same folder, says so         |
"""

import shutil

import pytest
import torch
import yaml

from dflash_core.checkpoint import save_load as ckpt
from dflash_core.checkpoint.folders import (
    checkpoint_step, latest_checkpoint, list_checkpoints,
)
from dflash_core.checkpoint.layout import STATE_PATH, CheckpointError
from dflash_core.pipeline.engine import Engine
from dflash_core.observe.events import Error, Log, RunEnded, RunStarted, StepMetrics
from dflash_core.observe.event_log import read_events
from dflash_core.checkpoint.resume import shape_differences
from dflash_core.config import ConfigError
from dflash_core.persist.run_folder import earlier_run, fresh_name, records_in, refuse_if_used

from ..engine_fixtures import (  # noqa: F401 - assets is a fixture
    assets, make_config, run_to_end, shutdown_started_engines,
)


@pytest.fixture(scope="module")
def done_run(tmp_path_factory, assets):
    """A finished 6-step run with checkpoints step-3 and step-6, made once; tests copy it."""
    root = tmp_path_factory.mktemp("done")
    target, data = assets
    cfg = make_config(root, target, data, data__eval_prompts=0)
    engine = Engine(cfg)
    rec = run_to_end(engine)
    engine.shutdown()
    assert rec.of(RunEnded)[0].status == "finished"
    assert [p.name for p in list_checkpoints(cfg.run_dir)] == ["step-3", "step-6"]
    return cfg.run_dir


def copy_run(done_run, tmp_path):
    shutil.copytree(done_run, tmp_path / "runs" / "t")
    return tmp_path / "runs" / "t"


def snapshot(folder):
    return {p.relative_to(folder): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file()}


def fatal(rec) -> Error:
    (err,) = [e for e in rec.of(Error) if e.fatal]
    return err


def run(cfg, **kw):
    engine = Engine(cfg, **kw)
    rec = run_to_end(engine)
    engine.shutdown()
    return engine, rec


def test_the_same_run_name_again_is_refused_and_touches_nothing(tmp_path, assets, done_run):
    target, data = assets
    run_dir = copy_run(done_run, tmp_path)
    before = snapshot(run_dir)
    engine, rec = run(make_config(tmp_path, target, data, data__eval_prompts=0))
    assert rec.of(RunEnded)[0].status == "failed"
    err = fatal(rec)
    assert err.error_kind == "config" and "run.name" in err.message
    assert str(run_dir) in err.message and "step-3, step-6" in err.message
    assert "--resume" in err.hint and "run.name" in err.hint and "--new-run" in err.hint
    assert not rec.of(StepMetrics)
    assert snapshot(run_dir) == before  # config.yaml, events.jsonl, checkpoints: all as they were


def test_new_run_starts_in_a_fresh_numbered_folder_and_says_so(tmp_path, assets, done_run):
    target, data = assets
    run_dir = copy_run(done_run, tmp_path)
    before = snapshot(run_dir)
    cfg = make_config(tmp_path, target, data, data__eval_prompts=0, run__max_steps=1)
    engine = Engine(cfg, new_run=True)
    assert engine.run_dir() == tmp_path / "runs" / "t-2"  # what --attach and the inbox see
    rec = run_to_end(engine)
    engine.shutdown()
    assert rec.of(RunEnded)[0].status == "finished"
    assert rec.of(RunStarted)[0].run_dir == str(tmp_path / "runs" / "t-2")
    assert any("t-2" in m.message and "earlier run" in m.message for m in rec.of(Log))
    assert snapshot(run_dir) == before
    assert (tmp_path / "runs" / "t-2" / "checkpoints" / "step-1").is_dir()
    assert fresh_name(tmp_path / "runs", "t") == "t-3"
    assert records_in(tmp_path / "runs" / "nothing-here") == []


def test_resume_of_another_drafter_shape_names_each_differing_key(tmp_path, assets, done_run):
    target, data = assets
    run_dir = copy_run(done_run, tmp_path)
    before = snapshot(run_dir)
    cfg = make_config(tmp_path, target, data, data__eval_prompts=0, drafter__num_layers=2,
                      drafter__block_size=8)
    engine, rec = run(cfg, resume=True)
    assert rec.of(RunEnded)[0].status == "failed" and not rec.of(StepMetrics)
    err = fatal(rec)
    assert err.error_kind == "config"
    assert "drafter.num_layers (num_hidden_layers): config 2, checkpoint 1" in err.message
    assert "drafter.block_size (dflash_config.block_size): config 8, checkpoint 4" in err.message
    assert "step-6" in err.message and "--new-run" in err.hint
    after = snapshot(run_dir)  # events.jsonl records the refused resume; nothing else changes
    assert {k: v for k, v in after.items() if k.name not in ("events.jsonl", "train.log")} == \
        {k: v for k, v in before.items() if k.name not in ("events.jsonl", "train.log")}


def test_shape_differences_ignore_what_does_not_change_the_model():
    a = {"num_hidden_layers": 4, "dflash_config": {"block_size": 16, "target_layer_ids": [1, 3]},
         "torch_dtype": "float32"}
    b = {"num_hidden_layers": 4, "dflash_config": {"block_size": 16, "target_layer_ids": [1, 2]},
         "torch_dtype": "bfloat16"}
    assert shape_differences(a, b) == [
        ("target.layer_ids", "dflash_config.target_layer_ids", [1, 3], [1, 2])]


def test_resume_with_nothing_to_resume_says_so(tmp_path, assets):
    target, data = assets
    cfg = make_config(tmp_path, target, data, data__eval_prompts=0, run__max_steps=1)
    engine, rec = run(cfg, resume=True)
    assert rec.of(RunEnded)[0].status == "finished"
    (warn,) = [m for m in rec.of(Log) if "nothing to resume" in m.message]
    assert warn.level == "warning" and "starting at step 0" in warn.message
    assert [m.step for m in rec.of(StepMetrics)] == [1]


def test_a_truncated_latest_checkpoint_is_named_kept_and_the_older_one_resumed(
        tmp_path, assets, done_run):
    target, data = assets
    run_dir = copy_run(done_run, tmp_path)
    weights = run_dir / "checkpoints" / "step-6" / "model.safetensors"
    data_bytes = weights.read_bytes()
    weights.write_bytes(data_bytes[: len(data_bytes) // 2])
    engine, rec = run(make_config(tmp_path, target, data, data__eval_prompts=0), resume=True)
    assert rec.of(RunEnded)[0].status == "finished", [e.message for e in rec.of(Error)]
    assert not rec.of(Error)
    warnings = [m.message for m in rec.of(Log) if m.level == "warning"]
    damaged = run_dir / "checkpoints" / "damaged-step-6"
    assert any(f"{run_dir / 'checkpoints' / 'step-6'} is damaged" in w and "model.safetensors"
               in w and str(damaged) in w for w in warnings), warnings
    assert any("resuming from" in w and "step-3" in w for w in warnings), warnings
    assert [m.step for m in rec.of(StepMetrics)] == [4, 5, 6]  # from step 3
    # the damaged one is kept as it was, never deleted, and no longer taken for a checkpoint
    assert (damaged / "model.safetensors").read_bytes() == data_bytes[: len(data_bytes) // 2]
    assert checkpoint_step(latest_checkpoint(run_dir)) == 6  # the new step-6


def test_every_checkpoint_damaged_fails_naming_them(tmp_path, assets, done_run):
    target, data = assets
    run_dir = copy_run(done_run, tmp_path)
    for step in (3, 6):
        (run_dir / "checkpoints" / f"step-{step}" / STATE_PATH).write_bytes(b"junk")
    engine, rec = run(make_config(tmp_path, target, data, data__eval_prompts=0), resume=True)
    assert rec.of(RunEnded)[0].status == "failed"
    err = fatal(rec)
    assert err.error_kind == "io" and "every one is damaged" in err.message
    assert "damaged-step-3" in err.message and "damaged-step-6" in err.message
    assert "losing steps 1 to 6" in err.message
    assert "backup" in err.hint and "--new-run" in err.hint
    assert not rec.of(StepMetrics)
    assert all((run_dir / "checkpoints" / f"damaged-step-{s}" / "model.safetensors").is_file()
               for s in (3, 6))


def test_load_checkpoint_names_the_damaged_file(tmp_path, done_run):
    run_dir = copy_run(done_run, tmp_path)
    folder = run_dir / "checkpoints" / "step-3"
    config = (folder / "config.json").read_bytes()
    (folder / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError) as e:
        ckpt.load_checkpoint(folder)
    assert f"checkpoint {folder} is damaged: config.json is truncated: 9 bytes of the " \
        f"{len(config)} written" in str(e.value)
    assert "older checkpoint" in e.value.hint
    (folder / "config.json").write_bytes(b"{" + config[1:-1] + b"!")  # same size, garbled
    with pytest.raises(CheckpointError, match=r"damaged: config.json does not match its "
                       r"checksum \(crc32 [0-9a-f]{8}, written [0-9a-f]{8}\)"):
        ckpt.load_checkpoint(folder)


def test_restart_of_a_new_run_resumes_its_own_folder(tmp_path, assets, done_run):
    # --new-run picks t-2 once; restart (r) resumes t-2, not the earlier run in t.
    target, data = assets
    copy_run(done_run, tmp_path)
    cfg = make_config(tmp_path, target, data, data__eval_prompts=0, run__max_steps=1)
    engine = Engine(cfg, new_run=True)
    run_to_end(engine)
    engine.resume = True
    cfg.run.max_steps = 2
    rec = run_to_end(engine)
    engine.shutdown()
    assert [m.step for m in rec.of(StepMetrics)] == [2]
    assert any("resuming from" in m.message and "t-2" in m.message for m in rec.of(Log))
    events = read_events(tmp_path / "runs" / "t-2" / "events.jsonl")
    assert len([e for e in events if isinstance(e, RunStarted)]) == 2



def test_resume_with_another_optimizer_names_both(tmp_path, assets, done_run):
    target, data = assets
    run_dir = copy_run(done_run, tmp_path)
    before = snapshot(run_dir)
    cfg = make_config(tmp_path, target, data, data__eval_prompts=0, optim__name="muon")
    engine, rec = run(cfg, resume=True)
    assert rec.of(RunEnded)[0].status == "failed" and not rec.of(StepMetrics)
    err = fatal(rec)
    assert err.error_kind == "config"
    assert "optim.name 'adamw'" in err.message and "asks for 'muon'" in err.message
    assert "step-6" in err.message and "optim.name: adamw" in err.hint
    after = snapshot(run_dir)
    assert {k: v for k, v in after.items() if k.name not in ("events.jsonl", "train.log")} == \
        {k: v for k, v in before.items() if k.name not in ("events.jsonl", "train.log")}


# --------------------------------------------------------------------------------------------
# A start refused by its preflight is no run to protect
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("wrong, key", [
    ({"target__layer_ids": [1, 99]}, "target.layer_ids"),
    pytest.param({"layout__device": "cuda"}, "layout.device", marks=pytest.mark.skipif(
        torch.cuda.is_available(), reason="the machine without CUDA of the report")),
])
def test_a_preflight_failure_then_a_corrected_retry_starts_in_the_same_folder(tmp_path, assets,
                                                                              wrong, key):
    """The first attempt is refused by preflight after its folder and records exist (a layer
    the target does not have; CUDA asked for where there is none); the corrected config starts
    there, and what it then trained is protected as before."""
    target, data = assets
    bad = make_config(tmp_path, target, data, data__eval_prompts=0, run__max_steps=1, **wrong)
    _, rec = run(bad)
    assert rec.of(RunEnded)[0].status == "failed"
    assert fatal(rec).message.startswith(key) or key in fatal(rec).message
    run_dir = bad.run_dir
    assert {"config.yaml", "events.jsonl", "train.log"} <= {p.name for p in run_dir.iterdir()}

    good = make_config(tmp_path, target, data, data__eval_prompts=0, run__max_steps=1)
    _, rec = run(good)
    assert rec.of(RunEnded)[0].status == "finished", [e.message for e in rec.of(Error)]
    assert rec.of(RunStarted)[0].run_dir == str(run_dir)
    assert any("earlier attempts" in m.message and "ended before a step" in m.message
               for m in rec.of(Log))
    assert yaml.safe_load((run_dir / "config.yaml").read_text()) == good.to_dict()  # the fixed one
    events = read_events(run_dir / "events.jsonl")  # both attempts, in order
    assert [e.status for e in events if isinstance(e, RunEnded)] == ["failed", "finished"]

    _, rec = run(good)  # now it holds a trained step and a checkpoint: refused, as ever
    assert rec.of(RunEnded)[0].status == "failed" and "already holds a run" in fatal(rec).message


def test_only_a_folder_with_something_to_lose_holds_a_run(tmp_path):
    """A checkpoint, a trained step, or a start without its end (maybe still running) make a
    run; attempts that all ended before a step, or a bare config.yaml, do not."""
    def folder(name, **files):
        d = tmp_path / name
        d.mkdir()
        for fname, text in files.items():
            (d / fname.replace("_", ".")).write_text(text)
        return d

    started = RunStarted(run_name="x", run_dir="", config={}, targets=[], drafters=[]).to_json()
    ended = RunEnded(status="failed", step=0, seconds=0.1, reason="no GPU").to_json()
    step = StepMetrics(step=1, epoch=0, loss=1.0, lr=1e-3, grad_norm=1.0, tokens_per_s=1.0,
                       samples_per_s=1.0, tau_tf=1.0).to_json()
    two_failed = "\n".join([started, ended, started, ended]) + "\n"
    assert earlier_run(folder("failed", events_jsonl=two_failed, train_log="x",
                              config_yaml="x")) == []
    assert earlier_run(folder("bare", config_yaml="x")) == []
    assert fresh_name(tmp_path, "failed") == "failed"
    assert earlier_run(folder("live", events_jsonl=two_failed + started + "\n")) == [
        "its last start in events.jsonl has not ended: it may still be running in another "
        "process, or that process was killed"]
    trained = folder("trained", events_jsonl="\n".join([started, step, ended]) + "\n")
    assert earlier_run(trained) == ["its events.jsonl has trained steps"]
    kept = folder("kept", events_jsonl=two_failed)
    (kept / "checkpoints" / "step-2").mkdir(parents=True)
    (kept / "checkpoints" / "step-2" / "model.safetensors").write_bytes(b"w")
    assert earlier_run(kept) == ["it has checkpoints"]
    with pytest.raises(ConfigError, match="already holds a run"):
        refuse_if_used(kept)
    assert fresh_name(tmp_path, "kept") == "kept-2"


def test_a_step_across_the_reading_chunk_edge_is_still_found(tmp_path, monkeypatch):
    from dflash_core.persist import run_folder

    step = StepMetrics(step=1, epoch=0, loss=1.0, lr=1e-3, grad_norm=1.0, tokens_per_s=1.0,
                       samples_per_s=1.0, tau_tf=1.0).to_json()
    cut = step.index('"event":"StepMetrics"') + 5
    monkeypatch.setattr(run_folder, "_CHUNK", 64)
    (tmp_path / "events.jsonl").write_text("x" * (64 - cut) + step + "\n")
    assert earlier_run(tmp_path) == ["its events.jsonl has trained steps"]
