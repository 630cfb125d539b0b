"""Background checkpoints at tiny sizes: what is staged is the step's state although training
goes on; a full disk or a killed writer leaves the previous checkpoint and a working resume."""

import errno
import json
import os
import signal
import time

import pytest
import torch

from dflash_core.checkpoint import save_load as ckpt
from dflash_core.checkpoint.folders import latest_checkpoint
from dflash_core.checkpoint.layout import CHECKSUMS, STATE_DIR
from dflash_core.checkpoint.checksums import Verified, verify
from dflash_core.checkpoint import safetensors_io
from dflash_core.checkpoint.async_writer import CheckpointWriter
from dflash_core.checkpoint.writer_loop import writer_main


def _model():
    torch.manual_seed(0)
    lin = torch.nn.Linear(64, 96)
    opt = torch.optim.AdamW(lin.parameters(), lr=1e-2)
    return lin, opt


def _train(lin, opt):
    lin(torch.randn(4, 64)).square().sum().backward()
    opt.step()
    opt.zero_grad()


def _job(lin, opt, step, writers):
    sd = {k: v.detach() for k, v in lin.state_dict().items()}
    return ckpt.make_job(step, drafter_state=sd, drafter_config={"step": step},
                         optimizer_state=opt.state_dict(), scheduler_state={"step": step},
                         trainer_state={"rng": ckpt.capture_rng_state()},
                         served_dtype=torch.bfloat16, writers=writers)


def _save(w, lin, opt, step):
    job = _job(lin, opt, step, w.writers)
    return w.save(job, [job.tensors], keep=3)


def _resumes(run_dir, step):
    loaded = ckpt.load_checkpoint(latest_checkpoint(run_dir))
    lin, opt = _model()
    lin.load_state_dict(loaded.drafter_state)
    opt.load_state_dict(loaded.optimizer_state)
    _train(lin, opt)  # a resumed optimizer steps
    assert loaded.step == step


def test_staged_state_is_the_step_although_training_went_on(tmp_path):
    lin, opt = _model()
    _train(lin, opt)
    w = CheckpointWriter(tmp_path, 2, mode="thread")
    try:
        w.start()
        job = _job(lin, opt, 1, 2)
        at_step = {k: v.clone() for k, v in job.tensors.items()}
        blocked = w.save(job, [job.tensors], keep=3)
        for _ in range(3):
            _train(lin, opt)  # goes on while the writers write
        out = w.wait(60)
    finally:
        w.close()
    assert out is not None and out.error == "" and out.path == tmp_path / "checkpoints" / "step-1"
    assert blocked < out.seconds + 1e-6 and out.bytes == job.bytes_total
    loaded = ckpt.load_checkpoint(out.path)
    for k, v in loaded.drafter_state.items():
        assert torch.equal(v, at_step[f"master/{k}"]) and v.dtype == torch.float32
    m = loaded.optimizer_state["state"][0]["exp_avg"]
    assert torch.equal(m, at_step["optimizer/state/0/exp_avg"])
    assert not torch.equal(m, opt.state_dict()["state"][0]["exp_avg"])  # training did go on
    served = ckpt.st.load_file(str(out.path / "model.safetensors"))
    assert all(t.dtype == torch.bfloat16 for t in served.values())
    # each writer wrote its shard into the training state's subfolder
    assert len([p for p in (out.path / STATE_DIR).iterdir()
                if p.name.startswith("training_state-")]) == 2
    # checksums.json holds every file of both writers, as they are on disk
    sums = json.loads((out.path / CHECKSUMS).read_text())["files"]
    assert set(sums) == {p.relative_to(out.path).as_posix() for p in out.path.rglob("*")
                         if p.is_file()} - {CHECKSUMS}
    assert all(sums[n]["bytes"] == (out.path / n).stat().st_size for n in sums)
    assert verify(out.path) == Verified(4, [], "")


def test_a_full_disk_leaves_the_previous_checkpoint(tmp_path, monkeypatch):
    lin, opt = _model()
    _train(lin, opt)
    w = CheckpointWriter(tmp_path, 2, mode="thread")
    try:
        w.start()
        _save(w, lin, opt, 1)
        assert w.wait(60).path is not None
        _train(lin, opt)

        def full(fd, view):
            raise OSError(errno.ENOSPC, "No space left on device")
        monkeypatch.setattr(safetensors_io, "_write", full)
        _save(w, lin, opt, 2)
        out = w.wait(60)
    finally:
        w.close()
    assert out.path is None and out.errno == errno.ENOSPC and "No space left" in out.error
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["step-1"]
    monkeypatch.undo()
    _resumes(tmp_path, 1)


def _slow_writer(index, jobs, results, progress):
    """A writer process that writes slowly, so the test can kill it mid-write."""
    real = safetensors_io._write

    def slow(fd, view):
        for i in range(0, len(view), 4096):
            real(fd, view[i: i + 4096])
            time.sleep(0.002)
    safetensors_io._write = slow
    writer_main(index, jobs, results, progress)


@pytest.mark.timeout(180)
def test_a_killed_writer_process_leaves_the_previous_checkpoint(tmp_path):
    lin, opt = _model()
    _train(lin, opt)
    w = CheckpointWriter(tmp_path, 1, mode="process", target=_slow_writer)
    try:
        w.start()
        _save(w, lin, opt, 1)
        first = w.wait(120)
        assert first is not None and first.path is not None, first
        _train(lin, opt)
        _save(w, lin, opt, 2)
        deadline = time.monotonic() + 60
        while int(w.progress.sum()) == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        (pid,) = w.pids()
        os.kill(pid, signal.SIGKILL)
        out = w.wait(60)
        assert out.path is None and "SIGKILL" in out.error, out
        assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["step-1"]
        _resumes(tmp_path, 1)
        # the next checkpoint starts a new writer and lands
        _train(lin, opt)
        _save(w, lin, opt, 3)
        out = w.wait(120)
        assert out.path is not None and w.pids() != [pid]
        assert verify(out.path) == Verified(4, [], "")  # a writer process's checksums
    finally:
        w.close()
