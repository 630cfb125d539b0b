"""The demo's drafter, trained a fixed short while and published, for the tests marked serve."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

STEPS = 200  # the demo's drafter, a short fixed training (tau ~3 on the held-out prompts)
PROMPTS = 12
NEW_TOKENS = 64


def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dflash_tui.cli", *args], cwd=cwd,
                          capture_output=True, text=True, timeout=1500,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})


@pytest.fixture(scope="session")
def published(tmp_path_factory, demo_target, demo_data) -> dict:
    """A demo run of STEPS steps, published; its held-out prompt set."""
    root = tmp_path_factory.mktemp("served")
    run = _cli("demo", "--headless", "--device", "cpu", "--max-steps", str(STEPS),
               "--output-dir", str(root / "runs"), cwd=root)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    pub = _cli("publish", str(root / "runs" / "demo"), "--out", str(root / "pub"), cwd=root)
    assert pub.returncode == 0, pub.stderr
    sets = Path(__file__).resolve().parents[2] / "bench" / "eval" / "demo_sets.py"
    made = subprocess.run([sys.executable, str(sets), str(root / "sets")], capture_output=True,
                          text=True, timeout=300)
    assert made.returncode == 0, made.stderr
    return {"root": root, "run": root / "runs" / "demo", "drafter": root / "pub",
            "target": root / "runs" / "demo" / "target",
            "heldout": root / "sets" / "heldout.jsonl"}
