"""The dashboard with a target split over two ranks: it starts (under Textual stderr has no file
descriptor, which multiprocessing's resource tracker once choked on), a SIGKILLed rank is named
on its own row, `r` restarts it and `a` aborts it, and a normal stop says nothing of ranks that
had to be forced."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[2]


def test_a_split_target_under_the_dashboard_starts_fails_restarts_and_aborts(tmp_path):
    out = tmp_path / "report.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    res = subprocess.run([sys.executable, "-m", "tests.tui.split_app_driver",
                          str(tmp_path / "w"), str(out)], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=280)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    r = json.loads(out.read_text())
    assert "timeout" not in r, (r.get("timeout"), r["headers"], r["errors"], r["logs"][-30:])
    assert "TRAINING" in r["headers"]["started"], r["errors"]
    # the kill is one error, under the dead rank's own row and device
    fatal = r["errors"][0]
    assert "rank 1 (cpu:0.1" in fatal["message"] and "killed by SIGKILL" in fatal["message"]
    assert fatal["source"] == "target-1" and fatal["device"] == "cpu:0.1 copy 0 rank 1/2", fatal
    assert r["error_row"][1] == "target-1", r["error_row"]
    assert "TRAINING" in r["headers"]["restarted"] and "ABORTED" in r["headers"]["aborted"]
    # a normal stop and a restart end their ranks within the grace time, without a word
    assert not [x for x in r["logs"] if "grace" in x or "terminated" in x], r["logs"]
    assert "leaked semaphore" not in res.stderr, res.stderr[-2000:]
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and any(psutil.pid_exists(p) for p in r["last_pids"]):
        time.sleep(0.1)
    assert not any(psutil.pid_exists(p) for p in r["pids"] + r["last_pids"])
