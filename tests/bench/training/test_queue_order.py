"""bench/training/queue_order.py runs both queues; with a target lagging, the shipped one's
steps still pair the plan's neighbours (the old one's often do not, by timing: not asserted)."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def test_with_a_lagging_target_the_shipped_queue_keeps_every_step_balanced():
    out = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "training" / "queue_order.py"), "--runs", "1",
         "--samples", "256", "--lag", "0.05"],
        capture_output=True, text=True, timeout=240, cwd=ROOT, check=True).stdout
    share = {line.split("  ")[0]: float(line.split("working share ")[1].split("-")[0])
             for line in out.splitlines() if "working share" in line}
    assert set(share) == {"earliest present", "plan order (shipped)"}
    assert share["plan order (shipped)"] >= 0.99  # the plan's pairs, whatever the timing
