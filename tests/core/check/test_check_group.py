"""`dflash-tui check` with a target group (target.gpus_per_copy 2, gloo on the CPU): the target
writes the samples, the drafter memorises them and decodes them through the group's ranks, with
the verdict, the samples and the exact tau of the same check on one device; a rank killed
during the check is named as a run names it (exit 1), no rank left behind; what cannot be
split is refused in one line (exit 2)."""

import os
import re
import signal
import subprocess
import sys

import psutil
import pytest
import yaml

from dflash_core.check.serve_check import CheckOptions, run_check
from dflash_core.config.load import config_from_dict

from ..engine_fixtures import make_data
from ..models.target.target_classes import build
from ..pipeline.test_headless import ROOT

OPTS = CheckOptions(reference=True, response_tokens=32)


def _config(tmp_path, cls: str = "qwen3", **target) -> dict:
    folder = tmp_path / cls
    if not folder.exists():
        build(cls).save_pretrained(folder)
    return {
        "run": {"name": "c", "output_dir": str(tmp_path / "runs"), "seed": 1},
        "target": {"path": str(folder), "dtype": "float32", "layer_ids": [1, 2], **target},
        "drafter": {"objective": "dflash", "num_layers": 1, "block_size": 8},
        "data": {"path": str(make_data(tmp_path / "data", n=4)), "token_budget": 512,
                 "max_seqs_per_batch": 4, "max_length": 160},
        "layout": {"device": "cpu", "targets": [0], "drafters": [0]},
    }


def _grouped(d: dict, mode: str = "sharded") -> dict:
    return {**d, "run": {**d["run"], "name": "g"},
            "target": {**d["target"], "gpus_per_copy": 2, "parallel": mode},
            "layout": {**d["layout"], "targets": [0, 1]}}


def test_the_check_through_a_group_is_the_check_on_one_device(tmp_path):
    d = _config(tmp_path)
    one = run_check(config_from_dict(d), OPTS, lambda m: None)
    lines: list[str] = []
    got = run_check(config_from_dict(_grouped(d)), OPTS, lines.append)
    assert got.verdict.passed == one.verdict.passed
    assert any("as a target group of 2 ranks" in m for m in lines), lines
    record = yaml.safe_load((got.folder / "check.json").read_text())
    want = yaml.safe_load((one.folder / "check.json").read_text())
    assert record["ours"]["tau"] == pytest.approx(want["ours"]["tau"], abs=1e-9)
    assert record["ours"]["accepted_at"] == want["ours"]["accepted_at"]
    assert record["memorise"]["steps"] == want["memorise"]["steps"]
    # the reference decodes with the whole model in this process: said, not run
    assert "target group" in got.reference and record["reference"] is None
    assert not _ranks_alive()


def _ranks_alive() -> list:
    out = []
    for c in psutil.Process().children(recursive=True):
        try:
            if c.status() != psutil.STATUS_ZOMBIE and "spawn_main" in " ".join(c.cmdline()):
                out.append(c)
        except psutil.Error:
            pass
    return out


def _check_cli(path, *more) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "dflash_tui.cli", "check", "--config",
                             str(path), "--no-reference", "--response-tokens", "16", *more],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})


@pytest.mark.slow  # fast path: test_eval_group.py's killed rank (the same group session)
def test_a_rank_killed_during_the_check_is_named_and_no_rank_is_left(tmp_path):
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(_grouped(_config(tmp_path))))
    proc = _check_cli(path)
    pids, out = [], []
    for line in proc.stdout:
        out.append(line)
        found = re.search(r"pids \[([\d, ]+)\]", line)
        if found:
            pids = [int(p) for p in found.group(1).split(", ")]
        if line.split("] ", 1)[-1].startswith("samples:") and pids:
            os.kill(pids[1], signal.SIGKILL)  # the target writes the samples through the ranks
    err = proc.stderr.read()
    rc = proc.wait(120)
    assert rc == 1, "".join(out) + err
    assert re.search(r"error \[oom\]: target group 0 rank 1 \(cpu:0\.1, pid \d+\) killed by "
                     r"SIGKILL", err), err
    assert "hint: SIGKILL" in err and "the same command again" in err and "Traceback" not in err
    for pid in pids:
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == "zombie"


def test_what_cannot_be_split_is_refused_in_one_line(tmp_path):
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(_grouped(_config(tmp_path, "qwen3_moe",
                                                    expert_parallel=False), mode="shared")))
    proc = _check_cli(path)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 2, out + err
    assert "tensor parallel alone leaves all 8 experts" in err and "Traceback" not in out + err
    assert "target.expert_parallel" in err
