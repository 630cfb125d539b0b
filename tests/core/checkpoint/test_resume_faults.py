"""A resume verifies its checkpoint and its data (docs/checkpoint-format.md, "checksums.json";
docs/bad-input.md, "Run folder and resume"), on the running engine with the tiny target.

| fault in the newest checkpoint (step-6 of 3, 6)   | what happens                                 |
|---------------------------------------------------|----------------------------------------------|
| a flipped bit in the training-state shard or the  | warning names the file and "does not match   |
| weights; a truncated or missing file; no          | its checksum" / "is truncated" / "is         |
| checksums.json                                    | missing"; moved to damaged-step-6 as it was; |
|                                                   | resumes from step 3 saying "steps 4 to 6 (3  |
|                                                   | steps) are trained again"                    |
| the only checkpoint damaged                       | [io] no intact checkpoint, the steps lost;   |
|                                                   | hint --new-run or a backup; refused again at |
|                                                   | the next --resume (never a silent restart)   |
| written before checksums and data identities      | resumes, with a note for each                |
| data.path replaced by another data set            | [config] data.path: both paths and data ids; |
|                                                   | the key data.allow_changed_data; exit 2      |
| the same, with data.allow_changed_data: true      | resumes, with a warning naming both          |
| the same data at another path                     | resumes, saying it moved                     |
"""

import json
import shutil

import pytest

from dflash_core.observe.events import Error, Log, RunEnded, StepMetrics
from dflash_core.checkpoint.folders import list_checkpoints
from dflash_core.checkpoint.layout import CHECKSUMS, STATE_DIR, STATE_JSON, STATE_PATH
from dflash_core.checkpoint.checksums import Verified, verify
from dflash_core.checkpoint.data_identity import data_identity
from dflash_core.pipeline.engine import Engine
from dflash_core.pipeline.exit_codes import exit_code

from ..engine_fixtures import (  # noqa: F401 - assets is a fixture
    assets, make_config, make_data, run_to_end, shutdown_started_engines,
)
from .old_formats import to_format

SHARD = f"{STATE_DIR}/training_state-00001-of-00001.safetensors"


@pytest.fixture(scope="module")
def done_run(tmp_path_factory, assets):
    """A finished 6-step run with checkpoints step-3 and step-6, trained on its own copy of the
    data (tests replace it), made once; tests copy both."""
    root = tmp_path_factory.mktemp("done")
    target, data = assets
    shutil.copytree(data, root / "data")
    cfg = make_config(root, target, root / "data", data__eval_prompts=0)
    engine = Engine(cfg)
    rec = run_to_end(engine)
    engine.shutdown()
    assert rec.of(RunEnded)[0].status == "finished"
    assert [p.name for p in list_checkpoints(cfg.run_dir)] == ["step-3", "step-6"]
    return root


def copy_run(done_run, tmp_path):
    """(run folder, data folder) copied from the finished run."""
    shutil.copytree(done_run / "runs", tmp_path / "runs")
    shutil.copytree(done_run / "data", tmp_path / "data")
    return tmp_path / "runs" / "t", tmp_path / "data"


def resume(tmp_path, assets, data, **over):
    """--resume of the copied run with the tiny target and ``data``; (config, events)."""
    cfg = make_config(tmp_path, assets[0], data, data__eval_prompts=0, **over)
    engine = Engine(cfg, resume=True)
    rec = run_to_end(engine)
    engine.shutdown()
    return cfg, rec


def fatal(rec) -> Error:
    (err,) = [e for e in rec.of(Error) if e.fatal]
    return err


def warnings(rec) -> list[str]:
    return [m.message for m in rec.of(Log) if m.level == "warning"]


def flip_bit(path):
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0x04
    path.write_bytes(bytes(raw))


def snapshot(folder):
    return {p.relative_to(folder): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file()}


FAULTS = {
    "flipped bit in the training-state shard": (
        lambda f: flip_bit(f / SHARD), f"is damaged: {SHARD} does not match its checksum"),
    "flipped bit in the weights": (
        lambda f: flip_bit(f / "model.safetensors"),
        "is damaged: model.safetensors does not match its checksum"),
    "truncated training-state shard": (
        lambda f: (f / SHARD).write_bytes((f / SHARD).read_bytes()[:1000]),
        f"is damaged: {SHARD} is truncated: 1000 bytes of the "),
    "missing training_state.json": (
        lambda f: (f / STATE_PATH).unlink(), f"is incomplete: {STATE_PATH} is missing"),
    "missing config.json": (
        lambda f: (f / "config.json").unlink(), "is incomplete: config.json is missing"),
    "missing shard": (lambda f: (f / SHARD).unlink(), f"is incomplete: {SHARD} is missing"),
    "missing checksums.json": (
        lambda f: (f / CHECKSUMS).unlink(),
        "is incomplete: checksums.json is missing (a checkpoint of format 3 or later writes it "
        "last)"),
}


@pytest.mark.parametrize("fault", list(FAULTS))
def test_a_damaged_newest_checkpoint_is_set_aside_and_the_older_one_resumed(
        tmp_path, assets, done_run, fault):
    run_dir, data = copy_run(done_run, tmp_path)
    step6 = run_dir / "checkpoints" / "step-6"
    damage, expected = FAULTS[fault]
    damage(step6)
    before = snapshot(step6)
    cfg, rec = resume(tmp_path, assets, data)
    assert rec.of(RunEnded)[0].status == "finished", [e.message for e in rec.of(Error)]
    aside = run_dir / "checkpoints" / "damaged-step-6"
    said = warnings(rec)
    assert f"resume: checkpoint {step6} {expected}" in said[0], said
    assert f"moved it to {aside} (kept, not deleted)" in said[0]
    assert f"resuming from {run_dir / 'checkpoints' / 'step-3'} (step 3), the newest intact " \
        "checkpoint: steps 4 to 6 (3 steps) are trained again" in said[1], said
    assert [m.step for m in rec.of(StepMetrics)] == [4, 5, 6]
    assert snapshot(aside) == before  # kept as it was, not overwritten by the new step-6
    assert verify(step6) == Verified(4, [], "")  # the new one
    log = (run_dir / "train.log").read_text()
    assert expected in log and "steps 4 to 6 (3 steps) are trained again" in log


def test_the_only_checkpoint_damaged_is_refused_every_time_not_started_over(tmp_path, assets,
                                                                           done_run):
    run_dir, data = copy_run(done_run, tmp_path)
    shutil.rmtree(run_dir / "checkpoints" / "step-6")
    flip_bit(run_dir / "checkpoints" / "step-3" / SHARD)
    before = snapshot(run_dir / "checkpoints" / "step-3")
    aside = run_dir / "checkpoints" / "damaged-step-3"
    for attempt in range(2):  # the second --resume finds only the folder set aside
        cfg, rec = resume(tmp_path, assets, data)
        assert rec.of(RunEnded)[0].status == "failed" and not rec.of(StepMetrics)
        err = fatal(rec)
        assert exit_code("failed", err.error_kind) == 1
        assert f"no intact checkpoint in {run_dir / 'checkpoints'}: every one is damaged and " \
            f"set aside ({aside}); resuming would start over, losing steps 1 to 3 (3 steps)" \
            in err.message
        assert "--new-run" in err.hint and "backup" in err.hint
        assert [p.name for p in (run_dir / "checkpoints").iterdir()] == ["damaged-step-3"]
        assert snapshot(aside) == before
        if attempt == 0:
            assert f"{SHARD} does not match its checksum" in warnings(rec)[0]


def test_a_checkpoint_written_before_checksums_and_data_identities_resumes_with_notes(
        tmp_path, assets, done_run):
    run_dir, data = copy_run(done_run, tmp_path)
    step6 = run_dir / "checkpoints" / "step-6"
    to_format(step6, 2)  # the training state at the top level, no checksums.json
    state = json.loads((step6 / STATE_JSON).read_text())
    del state["trainer"]["data"]
    (step6 / STATE_JSON).write_text(json.dumps(state))
    cfg, rec = resume(tmp_path, assets, data, run__max_steps=7)
    assert rec.of(RunEnded)[0].status == "finished" and not warnings(rec)
    notes = [m.message for m in rec.of(Log) if m.level == "info"]
    assert f"resume: {step6} was written before checksums (format 2): it cannot be verified; " \
        "resuming from it as it is" in notes
    assert any(f"resume: {step6} was written before checkpoints recorded their data" in n
               for n in notes)
    assert [m.step for m in rec.of(StepMetrics)] == [7]


def test_a_format_3_checkpoint_verifies_and_resumes(tmp_path, assets, done_run):
    # Format 3 kept the training state at the top level: readers fall back to it.
    run_dir, data = copy_run(done_run, tmp_path)
    step6 = to_format(run_dir / "checkpoints" / "step-6", 3)
    assert not (step6 / STATE_DIR).exists() and (step6 / STATE_JSON).is_file()
    assert verify(step6) == Verified(3, [], "")
    flip_bit(step6 / SHARD.split("/")[-1])
    assert verify(step6).problems[0].startswith(
        f"{SHARD.split('/')[-1]} does not match its checksum")
    run_dir, data = copy_run(done_run, tmp_path / "again")  # intact, to resume
    step6 = to_format(run_dir / "checkpoints" / "step-6", 3)
    cfg, rec = resume(tmp_path / "again", assets, data, run__max_steps=7)
    assert rec.of(RunEnded)[0].status == "finished" and not warnings(rec)
    assert any(m.message.startswith(f"resume: verified {step6} (") for m in rec.of(Log))
    assert [m.step for m in rec.of(StepMetrics)] == [7]
    step7 = run_dir / "checkpoints" / "step-7"
    assert verify(step7) == Verified(4, [], "") and (step7 / STATE_PATH).is_file()


def test_a_resume_on_another_data_set_is_refused_naming_both_and_allowed_with_the_key(
        tmp_path, assets):
    data = make_data(tmp_path / "data")
    cfg = make_config(tmp_path, assets[0], data, data__eval_prompts=0, run__max_steps=3)
    engine = Engine(cfg)
    assert run_to_end(engine).of(RunEnded)[0].status == "finished"
    engine.shutdown()
    step3 = cfg.run_dir / "checkpoints" / "step-3"
    trained_on = json.loads((step3 / STATE_PATH).read_text())["trainer"]["data"]
    shutil.rmtree(data)
    make_data(data, n=48, seed=7)  # another data set in the same folder
    now = data_identity(data, sorted(data.glob("*.arrow")), 48)
    assert now["id"] != trained_on["id"] and now["path"] == trained_on["path"] == str(data)
    before = snapshot(step3)
    cfg, rec = resume(tmp_path, assets, data, run__max_steps=5)
    assert rec.of(RunEnded)[0].status == "failed" and not rec.of(StepMetrics)
    err = fatal(rec)
    assert err.error_kind == "config" and exit_code("failed", err.error_kind) == 2
    assert (
        f"data.path: {data} (data {now['id']}: 2 shards, 48 samples, no manifest) is not the "
        f"data the checkpoint {step3} trained on, {data} (data {trained_on['id']}: 2 shards, "
        "64 samples, no manifest): its shards differ (names or sizes); set "
        "data.allow_changed_data: true to resume on it deliberately") in err.message
    assert f"put the data it trained on back in {data}" in err.hint
    assert "data.allow_changed_data: true" in err.hint and "--new-run" in err.hint
    assert snapshot(step3) == before

    cfg, rec = resume(tmp_path, assets, data, run__max_steps=5, data__allow_changed_data=True)
    assert rec.of(RunEnded)[0].status == "finished", [e.message for e in rec.of(Error)]
    (said,) = [w for w in warnings(rec) if "data.allow_changed_data" in w]
    assert f"is not the data the checkpoint {step3} trained on" in said
    assert now["id"] in said and trained_on["id"] in said and "epoch 0 with " in said
    assert [m.step for m in rec.of(StepMetrics)] == [4, 5]
    # the new checkpoint records the data it now trains on: the next resume takes it as is
    wrote = json.loads((cfg.run_dir / "checkpoints" / "step-5" / STATE_PATH)
                       .read_text())["trainer"]["data"]
    assert wrote["id"] == now["id"]


def test_the_same_data_at_another_path_resumes_saying_it_moved(tmp_path, assets, done_run):
    run_dir, data = copy_run(done_run, tmp_path)
    moved = tmp_path / "elsewhere"
    data.rename(moved)
    cfg, rec = resume(tmp_path, assets, moved, run__max_steps=7)
    assert rec.of(RunEnded)[0].status == "finished", [e.message for e in rec.of(Error)]
    assert any(f"the data moved from {done_run / 'data'} to {moved}; the same data" in m.message
               for m in rec.of(Log))
    assert [m.step for m in rec.of(StepMetrics)] == [7]


def test_a_damaged_checkpoint_as_drafter_init_from_is_refused_at_preflight(done_run, tmp_path,
                                                                          assets):
    run_dir, data = copy_run(done_run, tmp_path)
    init = run_dir / "checkpoints" / "step-3"
    flip_bit(init / "model.safetensors")
    target, _ = assets
    cfg = make_config(tmp_path, target, data, run__name="from-damaged",
                      drafter__init_from=str(init))
    engine = Engine(cfg)
    rec = run_to_end(engine)
    engine.shutdown()
    assert rec.of(RunEnded)[0].status == "failed" and not rec.of(StepMetrics)
    (err,) = [e for e in rec.of(Error) if e.fatal]
    assert err.error_kind == "config" and "drafter.init_from" in err.message
    assert "is damaged: model.safetensors does not match its checksum" in err.message
