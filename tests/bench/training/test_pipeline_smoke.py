"""bench/training/pipeline.py's one-sided runs at a toy size on the CPU (what --device cpu is
for): the target alone in the engine with its forward timed outside it, and the drafter alone."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[3] / "bench" / "training"


def pipeline(*args: str) -> str:
    out = subprocess.run([sys.executable, "pipeline.py", "--device", "cpu", "--targets", "0",
                          "--drafters", "0", "--steps", "8", *args], cwd=BENCH,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "final state finished, 8 steps" in out.stdout, out.stdout[-3000:]
    return out.stdout


def test_the_target_alone_trains_nothing_and_is_timed_outside_the_engine_too():
    text = pipeline("--drafter-work", "none", "--standalone", "2")
    assert re.search(r"RESULT samples/s [0-9.]+ .*loss 0\.000 -> 0\.000", text)
    assert re.search(r"STANDALONE target alone on 2 of the run's batches: [0-9,]+ real tokens/s "
                     r".*from a thread with its own stream and abort flag: [0-9,]+", text)


@pytest.mark.slow  # the fast path: the target-alone run of the same script, above
def test_the_drafter_alone_trains_on_random_features():
    text = pipeline("--features", "random")
    first, last = map(float, re.search(r"loss ([0-9.]+) -> ([0-9.]+)", text).groups())
    assert first > 0 and last > 0  # a real loss, not the idle drafter's zero
    assert "STANDALONE" not in text
