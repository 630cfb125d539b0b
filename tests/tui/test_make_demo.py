"""`make demo` and `make headless-demo` run through make itself, dflash-tui replaced by a stub
that exits as a run does: an abort (130, by design) ends make normally, a failure fails it with
the run's own code."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="needs make")


def make(target: str, code: int, tmp_path: Path) -> subprocess.CompletedProcess:
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True, exist_ok=True)
    stub = venv / "bin" / "dflash-tui"
    stub.write_text(f"#!/bin/sh\necho \"stub $*\"\nexit {code}\n", encoding="utf-8")
    stub.chmod(0o755)
    # Newer than pyproject.toml: make sees the install done and runs only the demo's line.
    (venv / ".installed").touch()
    return subprocess.run(["make", "--no-print-directory", "-C", str(ROOT), target,
                           f"VENV={venv}"], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "MAKEFLAGS": ""})


@pytest.mark.parametrize("target,args", [("demo", "demo"), ("headless-demo", "demo --headless")])
@pytest.mark.parametrize("code", [0, 130])
def test_a_finished_or_aborted_demo_ends_make_normally(target, args, code, tmp_path):
    done = make(target, code, tmp_path)
    assert f"stub {args}" in done.stdout  # the demo ran, with its flags
    assert done.returncode == 0, done.stderr
    assert "Error" not in done.stderr


@pytest.mark.parametrize("target", ["demo", "headless-demo"])
@pytest.mark.parametrize("code", [1, 2])
def test_a_failed_demo_still_fails_make_with_its_code(target, code, tmp_path):
    done = make(target, code, tmp_path)
    assert done.returncode != 0
    assert f"Error {code}" in done.stderr  # make names the run's own exit code
