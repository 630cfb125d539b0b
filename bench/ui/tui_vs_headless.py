"""TUI vs headless: training steps/s of the same run with the dashboard attached (inside tmux, as
an operator runs it) and with --headless. Measured from the StepMetrics timestamps each run writes
to its events.jsonl, skipping the first steps (warm-up).

    python bench/ui/tui_vs_headless.py --demo --steps 150 --repeats 2
    python bench/ui/tui_vs_headless.py --config my.yaml --steps 100
    python bench/ui/tui_vs_headless.py --demo --modes headless,attached   # dashboard in its own process
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SKIP = 10  # warm-up steps left out


def steps_per_s(events: Path) -> tuple[float, int]:
    pts = []
    for line in events.read_text().splitlines():
        try:
            ev = json.loads(line)
        except ValueError:
            continue
        if ev.get("event") == "StepMetrics":
            pts.append((ev["step"], ev["ts"]))
        if ev.get("event") == "RunStarted":
            pts = []  # only the last run in the file
    pts = [p for p in pts if p[0] > SKIP]
    if len(pts) < 2:
        return 0.0, len(pts)
    return (pts[-1][0] - pts[0][0]) / (pts[-1][1] - pts[0][1]), len(pts)


def wait_ended(events: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if events.exists() and '"event":"RunEnded"' in events.read_text():
            return
        time.sleep(0.5)
    raise TimeoutError(f"no RunEnded in {events} after {timeout} s")


def run_once(mode: str, base_args: list[str], out: Path, timeout: float) -> float:
    if out.exists():
        shutil.rmtree(out)
    exe = [sys.executable, "-m", "dflash_tui.cli", *base_args, "--output-dir", str(out)]
    events = out / "demo" / "events.jsonl"
    if mode == "headless":
        subprocess.run([*exe, "--headless"], check=True, stdout=subprocess.DEVNULL, timeout=timeout)
    elif mode == "attached":
        # Headless training, with a dashboard in its own process following it (--attach).
        proc = subprocess.Popen([*exe, "--headless"], stdout=subprocess.DEVNULL)
        session = f"bench{int(time.time())}"
        try:
            deadline = time.monotonic() + timeout
            while not events.exists() and time.monotonic() < deadline:
                time.sleep(0.1)
            attach = [sys.executable, "-m", "dflash_tui.cli", "--attach", str(events.parent)]
            subprocess.run(["tmux", "new-session", "-d", "-s", session, "-x", "160", "-y", "48",
                            " ".join(attach)], check=True)
            proc.wait(timeout)
        finally:
            subprocess.run(["tmux", "kill-session", "-t", session], check=False)
            if proc.poll() is None:
                proc.kill()
    else:
        session = f"bench{int(time.time())}"
        cmd = " ".join(exe)
        subprocess.run(["tmux", "new-session", "-d", "-s", session, "-x", "160", "-y", "48", cmd],
                       check=True)
        try:
            wait_ended(events, timeout)
        finally:
            subprocess.run(["tmux", "kill-session", "-t", session], check=False)
    rate, n = steps_per_s(events)
    print(f"{mode:8s} {rate:.3f} steps/s over {n} steps", flush=True)
    return rate


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--demo", action="store_true")
    ap.add_argument("--config")
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=1200)
    ap.add_argument("--modes", default="headless,tui",
                    help="compared with the first: tui (dashboard owns the engine), attached "
                         "(headless engine, dashboard in another process via --attach)")
    args = ap.parse_args()
    base = ["--demo"] if args.demo else ["--config", args.config]
    base += ["--max-steps", str(args.steps)]
    tmp = Path(tempfile.mkdtemp())
    modes = args.modes.split(",")
    rates = {m: [] for m in modes}
    for r in range(args.repeats):
        for mode in modes if r % 2 == 0 else modes[::-1]:
            rates[mode].append(run_once(mode, base, tmp / mode, args.timeout))
    mean = {m: sum(v) / len(v) for m, v in rates.items()}
    ref = modes[0]
    for m in modes[1:]:
        print(f"RESULT {ref} {mean[ref]:.3f} steps/s, {m} {mean[m]:.3f} steps/s, ratio "
              f"{m}/{ref} {mean[m] / mean[ref]:.3f}")


if __name__ == "__main__":
    main()
