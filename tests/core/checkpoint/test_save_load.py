import errno
import json
import os
import random
import signal
import subprocess
import sys
import time
import zlib
from pathlib import Path

import numpy as np
import pytest
import safetensors.torch
import torch

from dflash_core.checkpoint.save_load import (
    capture_rng_state, load_checkpoint, restore_rng_state, save_checkpoint,
)
from dflash_core.checkpoint.folders import (
    checkpoint_step, damaged_folders, latest_checkpoint, list_checkpoints, step_folders,
)
from dflash_core.checkpoint.layout import (
    CHECKSUMS, FILES, STATE_DIR, STATE_PATH, CheckpointError,
)
from dflash_core.checkpoint.checksums import Verified, verify
from tests.core.checkpoint.old_formats import to_format
from tests.core.checkpoint.read_only import read_only  # noqa: F401  (a fixture)

REPO = Path(__file__).resolve().parents[3]


def _save(run_dir, step, keep=3, fill=None, **extra):
    value = float(step if fill is None else fill)
    state = {"fc.weight": torch.full((8, 4), value), "norm.weight": torch.full((4,), value)}
    args = dict(drafter_state=state, drafter_config={"architectures": ["DFlashDraftModel"],
                                                     "value": value},
                optimizer_state={}, scheduler_state={}, trainer_state={"value": value}, keep=keep)
    args.update(extra)
    return save_checkpoint(run_dir, step, **args)


def _draws():
    return (random.random(), np.random.rand(3).tolist(), torch.rand(3).tolist(),
            torch.randint(0, 1000, (4,)).tolist())


def test_round_trip_and_rng(tmp_path):
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5)
    random.gauss(0, 1)  # leaves a cached gaussian in python's state
    rng = capture_rng_state()
    expected = _draws()
    drafter = {"fc.weight": torch.randn(3, 4).t(),  # non-contiguous on purpose
               "layers.0.mlp.up_proj.weight": torch.randn(5, 2, dtype=torch.bfloat16)}
    config = {"architectures": ["DFlashDraftModel"], "num_target_layers": 36,
              "dflash_config": {"target_layer_ids": [1, 9], "block_size": 16, "mask_token_id": 7}}
    trainer = {"epoch": 1, "position": 123, "order": torch.arange(5), "rng": rng}
    path = save_checkpoint(tmp_path, 42, drafter_state=drafter, drafter_config=config,
                           optimizer_state=opt.state_dict(), scheduler_state=sched.state_dict(),
                           trainer_state=trainer, keep=2)
    assert path == tmp_path / "checkpoints" / "step-42"
    # The top level is the served folder; the training state lies in its subfolder.
    assert sorted(p.name for p in path.iterdir()) == [
        CHECKSUMS, "config.json", "model.safetensors", STATE_DIR]
    assert sorted(p.relative_to(path).as_posix() for p in path.rglob("*") if p.is_file()) == \
        sorted(FILES + (SHARD, CHECKSUMS))
    # The weights are plain interchange format, readable without this package.
    assert set(safetensors.torch.load_file(str(path / "model.safetensors"))) == set(drafter)
    # No pickle: the training state is JSON and safetensors.
    assert not any(p.suffix == ".pt" for p in path.rglob("*"))

    _draws()  # move every generator on
    ck = load_checkpoint(path)
    assert ck.step == 42 and ck.drafter_config == config
    for k, v in drafter.items():
        assert torch.equal(ck.drafter_state[k], v)
    assert ck.trainer_state["position"] == 123
    assert torch.equal(ck.trainer_state["order"], torch.arange(5))
    assert ck.scheduler_state == sched.state_dict()
    opt2 = torch.optim.AdamW(torch.nn.Linear(4, 3).parameters(), lr=1e-3)
    opt2.load_state_dict(ck.optimizer_state)
    assert torch.equal(opt2.state_dict()["state"][0]["exp_avg"],
                       opt.state_dict()["state"][0]["exp_avg"])
    restore_rng_state(ck.trainer_state["rng"])
    assert _draws() == expected


def test_keep_pruning_and_replace(tmp_path):
    for step in range(1, 6):
        _save(tmp_path, step, keep=2)
    assert [checkpoint_step(p) for p in list_checkpoints(tmp_path)] == [4, 5]
    _save(tmp_path, 5, keep=2, fill=99)  # same step again (e.g. abort right after resume)
    assert load_checkpoint(latest_checkpoint(tmp_path)).trainer_state["value"] == 99
    _save(tmp_path, 2, keep=2)  # the folder just written is never pruned
    assert [checkpoint_step(p) for p in list_checkpoints(tmp_path)] == [2, 4, 5]
    assert [p.name for p in (tmp_path / "checkpoints").iterdir() if p.name.startswith(".")] == []


def test_a_pruned_folder_that_is_deleted_only_in_part_goes_back_under_its_name(
        tmp_path, monkeypatch):
    # It was renamed to a hidden .del-step-N-<pid> and left there, space not freed, nothing said
    # (then said, but still hidden). A busy or immutable file stops the delete part way.
    import shutil
    real = shutil.rmtree

    def stuck(path, ignore_errors=False, onerror=None, **kw):
        if ".del-step-1-" in str(path):
            os.unlink(os.path.join(path, "model.safetensors"))
            err = PermissionError(13, "Permission denied")
            onerror(os.unlink, os.path.join(path, "config.json"), (type(err), err, None))
            return
        real(path, ignore_errors=ignore_errors, onerror=onerror, **kw)

    _save(tmp_path, 1, keep=1)
    monkeypatch.setattr(shutil, "rmtree", stuck)
    notes: list[str] = []
    _save(tmp_path, 2, keep=1, note=notes.append)
    root = tmp_path / "checkpoints"
    assert [checkpoint_step(p) for p in list_checkpoints(tmp_path)] == [2]
    assert sorted(p.name for p in root.iterdir()) == ["step-1", "step-2"]  # nothing hidden
    (line,) = notes
    assert line.startswith("checkpoint.keep 1: could not delete step-1 (Permission denied: "
                           f"{root / 'step-1' / 'config.json'}; partly deleted")
    assert "under its name" in line and "remove it by hand" in line
    assert load_checkpoint(root / "step-2").trainer_state["value"] == 2.0


def test_a_read_only_checkpoint_is_kept_whole_under_its_name_and_said_once(tmp_path, read_only):
    """Issue 59: pruning renamed it to a hidden .del- folder, deleted what it could and left the
    rest hidden. Now nothing of it is touched; the warning is said once; the next save tries
    again and deletes it once it is writable."""
    _save(tmp_path, 1, keep=1)
    root = tmp_path / "checkpoints"
    read_only(root / "step-1" / STATE_DIR)  # the rename would work, the delete would not
    notes: list[str] = []
    _save(tmp_path, 2, keep=1, note=notes.append)
    assert sorted(p.name for p in root.iterdir()) == ["step-1", "step-2"]
    assert [checkpoint_step(p) for p in list_checkpoints(tmp_path)] == [1, 2]  # whole
    (line,) = notes
    assert line.startswith("checkpoint.keep 1: could not delete step-1 (")
    assert str(root / "step-1" / STATE_DIR) in line and "partly" not in line
    assert f"it stays in {root} under its name" in line and "step-2 is written" in line
    assert load_checkpoint(root / "step-2").trainer_state["value"] == 2.0
    _save(tmp_path, 3, keep=1, note=notes.append)  # tried again, said once
    assert len(notes) == 1
    assert sorted(p.name for p in root.iterdir()) == ["step-1", "step-3"]
    read_only.undo()
    _save(tmp_path, 4, keep=1, note=notes.append)
    assert sorted(p.name for p in root.iterdir()) == ["step-4"] and len(notes) == 1


def test_latest_ignores_tmp_and_incomplete(tmp_path):
    assert latest_checkpoint(tmp_path) is None
    _save(tmp_path, 2)
    root = tmp_path / "checkpoints"
    (root / ".tmp-step-9-12345" / STATE_DIR).mkdir(parents=True)
    for name in FILES:
        (root / ".tmp-step-9-12345" / name).write_bytes(b"x")
    (root / "step-8").mkdir()
    (root / "step-8" / "config.json").write_text("{}")
    (root / "notes").mkdir()
    assert latest_checkpoint(tmp_path) == root / "step-2"
    with pytest.raises(CheckpointError, match="incomplete"):
        load_checkpoint(root / "step-8")
    _save(tmp_path, 3)  # cleans stale tmp folders of dead processes
    assert not (root / ".tmp-step-9-12345").exists()


def test_crash_while_replacing_keeps_the_old_copy(tmp_path):
    _save(tmp_path, 1)
    _save(tmp_path, 2, fill=7)
    root = tmp_path / "checkpoints"
    # As if a save of step 2 died after moving the old step-2 aside, before the new one landed.
    os.rename(root / "step-2", root / ".old-step-2-999999")
    (root / ".tmp-step-2-999999").mkdir()
    latest = latest_checkpoint(tmp_path)
    assert checkpoint_step(latest) == 2 and load_checkpoint(latest).trainer_state["value"] == 7
    _save(tmp_path, 3)  # the next save puts it back under its name
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step-1", "step-2", "step-3"]
    assert load_checkpoint(root / "step-2").trainer_state["value"] == 7


@pytest.mark.parametrize("exc", [
    OSError(errno.ENOSPC, "No space left on device"),
    # safetensors wraps I/O errors in its own exception type
    Exception("Error while serializing: I/O error: No space left on device (os error 28)"),
])
def test_write_failure_leaves_nothing(tmp_path, monkeypatch, exc):
    _save(tmp_path, 1)

    def full_disk(*args, **kwargs):
        raise exc

    from dflash_core.checkpoint import safetensors_io
    monkeypatch.setattr(safetensors_io, "_write", full_disk)
    with pytest.raises(CheckpointError) as err:
        _save(tmp_path, 2)
    assert isinstance(err.value, OSError) and err.value.error_kind == "io"
    assert err.value.errno == errno.ENOSPC and "free disk space" in err.value.hint
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step-1"]
    assert load_checkpoint(latest_checkpoint(tmp_path)).step == 1


def test_unpicklable_state_refused_before_writing(tmp_path):
    with pytest.raises(TypeError, match="cannot be stored in a checkpoint"):
        _save(tmp_path, 1, trainer_state={"rng": np.random.get_state()})
    assert not (tmp_path / "checkpoints").exists()


# One python process imports torch once, then forks a writer per round (a fresh interpreter per
# kill would spend seconds importing torch). The writer saves ~4 MiB checkpoints in a loop, every
# tensor holding its step number; it first re-saves the latest step (the replace path).
ZYGOTE = """
import os, sys, torch
from dflash_core.checkpoint.save_load import save_checkpoint
from dflash_core.checkpoint.folders import checkpoint_step, latest_checkpoint
run_dir = sys.argv[1]
print("ready", flush=True)
for _ in sys.stdin:
    pid = os.fork()
    if pid == 0:
        last = latest_checkpoint(run_dir)
        step = checkpoint_step(last) if last else 1
        while True:
            v = float(step)
            save_checkpoint(
                run_dir, step,
                drafter_state={f"w{i}": torch.full((256, 1024), v) for i in range(4)},
                drafter_config={"step": step}, optimizer_state={"m": torch.full((4096,), v)},
                scheduler_state={"last_epoch": step}, trainer_state={"step": step}, keep=3)
            step += 1
    print(pid, flush=True)
    print(os.waitpid(pid, 0)[1], flush=True)  # reaped: the writer is gone before the check
"""


def _check_consistent(run_dir):
    root = Path(run_dir) / "checkpoints"
    for folder in root.glob("step-*"):
        assert all((folder / name).is_file() for name in FILES), f"{folder} is missing files"
    latest = latest_checkpoint(run_dir)
    assert latest is not None
    ck = load_checkpoint(latest)
    step = checkpoint_step(latest)
    assert ck.step == step and ck.drafter_config == {"step": step}
    assert ck.scheduler_state == {"last_epoch": step} and ck.trainer_state == {"step": step}
    assert torch.all(ck.optimizer_state["m"] == step)
    assert len(ck.drafter_state) == 4
    assert all(torch.all(t == step) for t in ck.drafter_state.values())
    return step


def test_sigkill_never_leaves_a_half_checkpoint(tmp_path):
    rng = random.Random(1234)
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    zygote = subprocess.Popen([sys.executable, "-c", ZYGOTE, str(tmp_path)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, env=env, cwd=REPO, text=True)
    steps = []
    try:
        assert zygote.stdout.readline().strip() == "ready"
        for _ in range(6):
            zygote.stdin.write("go\n")
            zygote.stdin.flush()
            writer = int(zygote.stdout.readline())
            time.sleep(rng.uniform(0.05, 0.5))
            deadline = time.monotonic() + 20  # at least one save has landed before the kill
            while latest_checkpoint(tmp_path) is None and time.monotonic() < deadline:
                time.sleep(0.01)
            os.kill(writer, signal.SIGKILL)
            assert int(zygote.stdout.readline()) == signal.SIGKILL  # wait status: killed
            steps.append(_check_consistent(tmp_path))
    finally:
        zygote.kill()
        zygote.wait(10)
    assert steps == sorted(steps) and steps[-1] > 1, steps
    # The next save cleans whatever the killed writers left behind.
    _save(tmp_path, steps[-1] + 1, keep=3)
    leftovers = [p.name for p in (tmp_path / "checkpoints").iterdir() if p.name.startswith(".")]
    assert leftovers == []


def test_loading_reports_bytes_and_shards_and_a_resume_shows_them(tmp_path):
    from dflash_core.observe.events import LoadProgress
    from dflash_core.checkpoint.resume import load_for_resume

    _save(tmp_path, 3, optimizer_state={"state": {0: {"exp_avg": torch.ones(64, 64)}},
                                        "param_groups": []})
    calls = []
    folder = latest_checkpoint(tmp_path)
    load_checkpoint(folder, progress=lambda *a: calls.append(a))
    # every file is read once, to verify it: config, weights, training state and its shard
    read, total, files, of = calls[-1]
    on_disk = sum(p.stat().st_size for p in folder.rglob("*")
                  if p.is_file() and p.name != CHECKSUMS)
    assert read == total == on_disk > 64 * 64 * 4 and (files, of) == (4, 4)
    assert all(c[3] == 4 and 0 <= c[2] <= 4 for c in calls) and calls[0][2] == 0
    assert [c[0] for c in calls] == sorted(c[0] for c in calls)
    seen = []
    loaded = load_for_resume(tmp_path, None, seen.append)
    assert loaded.step == 3 and loaded.note == ""
    shown = [e for e in seen if isinstance(e, LoadProgress)]
    assert shown[-1].done and (shown[-1].shards_loaded, shown[-1].shards_total) == (4, 4)
    assert shown[-1].worker == "checkpoint" and shown[-1].bytes_loaded == total


# --------------------------------------------------------------------------------------------
# Verification: checksums.json (format 3), and what older formats allow
# --------------------------------------------------------------------------------------------

SHARD = f"{STATE_DIR}/training_state-00001-of-00001.safetensors"


def flip_bit(path, at=None):
    """One bit of ``path`` flipped in place (the middle of the file by default); size unchanged."""
    raw = bytearray(path.read_bytes())
    at = len(raw) // 2 if at is None else at
    raw[at] ^= 0x04
    path.write_bytes(bytes(raw))


def test_every_file_is_checksummed_and_a_flipped_bit_is_named(tmp_path):
    folder = _save(tmp_path, 1, optimizer_state={"m": torch.ones(1000)})
    sums = json.loads((folder / CHECKSUMS).read_text())
    assert sums["format"] == 4 and sums["algorithm"] == "crc32"
    assert set(sums["files"]) == set(FILES) | {SHARD}
    for name, entry in sums["files"].items():
        raw = (folder / name).read_bytes()
        assert entry == {"bytes": len(raw), "crc32": f"{zlib.crc32(raw):08x}"}
    assert verify(folder) == Verified(4, [], "")
    flip_bit(folder / SHARD)
    v = verify(folder)
    assert v.kind == "damaged" and len(v.problems) == 1
    assert v.problems[0].startswith(f"{SHARD} does not match its checksum (crc32 ")
    assert verify(folder, read=False).problems == []  # sizes alone cannot see a flipped bit
    with pytest.raises(CheckpointError, match=f"is damaged: {SHARD} does not match") as e:
        load_checkpoint(folder)
    assert e.value.errno == errno.EIO


@pytest.mark.parametrize("fault, expected", [
    (f"missing:{STATE_PATH}", f"is incomplete: {STATE_PATH} is missing"),
    ("missing:config.json", "is incomplete: config.json is missing"),
    (f"missing:{SHARD}", f"is incomplete: {SHARD} is missing"),
    ("missing:checksums.json",
     "is incomplete: checksums.json is missing (a checkpoint of format 3 or later writes it last)"),
    ("truncated:model.safetensors", "is damaged: model.safetensors is truncated: "),
    ("garbled:checksums.json", "is damaged: checksums.json cannot be read (JSONDecodeError"),
    ("longer:config.json", "is damaged: config.json is "),
])
def test_an_incomplete_or_damaged_folder_names_what_is_wrong(tmp_path, fault, expected):
    folder = _save(tmp_path, 1)
    how, name = fault.split(":")
    path = folder / name
    if how == "missing":
        path.unlink()
    elif how == "truncated":
        path.write_bytes(path.read_bytes()[:-10])
    elif how == "garbled":
        path.write_text("{not json")
    else:
        path.write_bytes(path.read_bytes() + b" ")
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(folder)
    assert f"checkpoint {folder} {expected}" in str(e.value), str(e.value)
    assert (e.value.errno == errno.ENOENT) == (how == "missing")


def test_a_folder_written_before_checksums_loads_with_a_note(tmp_path):
    folder = to_format(_save(tmp_path, 4), 2)
    loaded = load_checkpoint(folder)
    assert loaded.step == 4 and loaded.format == 2
    assert loaded.note == "written before checksums (format 2): it cannot be verified"
    shard = Path(SHARD).name  # at the top level in format 2
    (folder / shard).write_bytes((folder / shard).read_bytes()[:-4])  # sizes are still checked
    with pytest.raises(CheckpointError, match=f"damaged: {shard} is truncated: "):
        load_checkpoint(folder)


def test_a_damaged_folder_of_the_step_being_written_is_set_aside_not_overwritten(tmp_path):
    root = tmp_path / "checkpoints"
    _save(tmp_path, 2, fill=1)
    (root / "step-2" / STATE_PATH).unlink()

    def files(folder):
        return {p.relative_to(folder): p.read_bytes() for p in folder.rglob("*") if p.is_file()}
    before = files(root / "step-2")
    notes = []
    _save(tmp_path, 2, fill=5, note=notes.append)
    (note,) = notes
    assert f"checkpoint {root / 'step-2'} is damaged ({STATE_PATH} is missing)" in note
    assert f"moved it to {root / 'damaged-step-2'} (kept, not deleted)" in note
    assert files(root / "damaged-step-2") == before
    assert load_checkpoint(root / "step-2").trainer_state["value"] == 5
    # an intact one of the same step is replaced as before, and a second damaged one is kept
    # beside the first
    _save(tmp_path, 2, fill=6, note=notes.append)
    assert len(notes) == 1 and load_checkpoint(root / "step-2").trainer_state["value"] == 6
    (root / "step-2" / SHARD).write_bytes(b"")
    _save(tmp_path, 2, fill=7, note=notes.append)
    assert f"{SHARD} is truncated: 0 bytes" in notes[1]
    assert len(damaged_folders(tmp_path)) == 2 and [p.name for p in list_checkpoints(tmp_path)] \
        == ["step-2"]


def test_step_folders_include_the_incomplete_ones_list_checkpoints_skips(tmp_path):
    _save(tmp_path, 1)
    _save(tmp_path, 2)
    (tmp_path / "checkpoints" / "step-2" / "config.json").unlink()
    (tmp_path / "checkpoints" / "step-3").mkdir()
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step-1"]
    assert [p.name for p in step_folders(tmp_path)] == ["step-1", "step-2", "step-3"]
