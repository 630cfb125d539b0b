"""The dashboard owning a target split over two ranks (CPU, gloo), driven by Textual's pilot in
a process of its own: multiprocessing's resource tracker starts once per process, so only a
fresh process meets the dashboard's stderr (no file descriptor) at the group's first start.

``python -m tests.tui.split_app_driver TMP OUT.json``: start the run, SIGKILL rank 1 once a
checkpoint is written, restart with ``r``, abort with ``a``; what the screen and the event stream
showed goes to OUT.json for the test to judge.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import sys
import time
from pathlib import Path

SIZE = (120, 40)


async def _until(pilot, predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not within {timeout} s")
        await pilot.pause(0.1)


def main(tmp: Path, out: Path) -> None:
    from dflash_core.observe.events import Checkpoint, Error, Log
    from dflash_core.pipeline.engine import Engine
    from dflash_tui.app import DFlashApp
    from tests.core.engine_fixtures import make_config, make_data, make_target

    cfg = make_config(tmp, make_target(tmp / "target"), make_data(tmp / "data"),
                      layout__targets=[0, 1], target__gpus_per_copy=2, data__eval_prompts=0,
                      run__max_steps=100_000, optim__epochs=500, checkpoint__every=2)
    engine = Engine(cfg)
    seen: dict[str, list] = {"logs": [], "errors": [], "checkpoints": []}

    def tap(ev) -> None:
        if isinstance(ev, Log):
            seen["logs"].append(f"[{ev.level}] {ev.source}: {ev.message}")
        elif isinstance(ev, Error):
            seen["errors"].append({"source": ev.source, "device": ev.device,
                                   "message": ev.message, "kind": ev.error_kind})
        elif isinstance(ev, Checkpoint):
            seen["checkpoints"].append(ev.step)
    engine.bus.tap(tap)
    app = DFlashApp(engine)
    report: dict = {"headers": {}}

    def header() -> str:
        return app.query_one("#header").text

    def pids() -> list[int]:
        for line in reversed(seen["logs"]):
            m = re.search(r"target group 0: 2 ranks .* pids \[([\d, ]+)\]", line)
            if m:
                return [int(p) for p in m.group(1).split(", ")]
        return []

    async def drive() -> None:
        async with app.run_test(size=SIZE) as pilot:
            try:
                await _until(pilot, lambda: "TRAINING" in header() or "FAILED" in header(), 90,
                             "training")
                report["headers"]["started"] = header()
                if "FAILED" in header():
                    return
                await _until(pilot, lambda: seen["checkpoints"], 60, "a checkpoint")
                killed = pids()
                report["pids"] = killed
                os.kill(killed[1], signal.SIGKILL)
                await _until(pilot, lambda: "FAILED" in header(), 30, "the failure")
                report["headers"]["killed"] = header()
                table = app.query_one("#errors").table
                await _until(pilot, lambda: table.row_count >= 1, 5, "the error row")
                report["error_row"] = [str(c) for c in table.get_row_at(table.row_count - 1)]
                logs_before_restart = len(seen["logs"])
                await pilot.press("r")
                await pilot.press("y")
                await _until(pilot, lambda: pids() != killed and "TRAINING" in header(), 90,
                             "training after the restart")
                report["headers"]["restarted"] = header()
                report["restart_logged"] = [x for x in seen["logs"][logs_before_restart:]
                                            if "restart" in x.lower()]
                await pilot.pause(1.0)
                await pilot.press("a")
                await pilot.press("y")
                await _until(pilot, lambda: "ABORTED" in header(), 30, "the abort")
                report["headers"]["aborted"] = header()
                report["last_pids"] = pids()
            except TimeoutError as exc:
                report["timeout"] = str(exc)
                report["headers"]["at_timeout"] = header()
    asyncio.run(drive())
    engine.shutdown(10)
    report.update(seen)
    out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
