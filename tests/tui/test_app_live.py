"""The dashboard driving a real engine (tiny random target on CPU): an injected error shows at
once and the run goes on; a broken config is shown with its hint and `r` after the fix resumes."""

import threading
import time
from pathlib import Path

import pytest
import yaml

from dflash_core.config import save_config
from dflash_core.pipeline.engine import Engine
from dflash_core.observe.events import Error, Log
from dflash_tui.app import DFlashApp
from tests.core.engine_fixtures import make_config, make_data, make_target

SIZE = (160, 48)
pytestmark = pytest.mark.anyio


async def wait_for(pilot, predicate, timeout: float) -> float:
    start = time.monotonic()
    while not predicate():
        if time.monotonic() - start > timeout:
            raise AssertionError(f"condition not met in {timeout} s")
        await pilot.pause(0.05)
    return time.monotonic() - start


def header(app) -> str:
    return app.query_one("#header").text


async def test_error_injected_into_a_live_run_shows_within_a_second(tmp_path: Path):
    cfg = make_config(tmp_path, make_target(tmp_path / "t"), make_data(tmp_path / "d", n=400),
                      run__max_steps=100_000, optim__epochs=50)
    engine = Engine(cfg)
    app = DFlashApp(engine)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: "TRAINING" in header(app), timeout=60)
        threading.Thread(target=engine.bus.publish, args=(Error(
            error_kind="cuda", source="target-0", message="injected: ECC error",
            hint="drain the node", fatal=False, device="cuda:0", phase="training"),)).start()
        errors = app.query_one("#errors")
        took = await wait_for(pilot, lambda: errors.table.row_count == 1, timeout=5)
        assert took < 1.0
        assert "injected: ECC error" in errors.detail_text and "drain the node" in errors.detail_text
        await pilot.pause(1.0)
        assert "TRAINING" in header(app) and app.is_running  # a non-fatal error stops nothing
        await pilot.press("a")
        await pilot.press("y")
        await wait_for(pilot, lambda: "ABORTED" in header(app), timeout=10)
    engine.shutdown(10)


async def test_bad_config_is_shown_and_r_after_the_fix_resumes(tmp_path: Path):
    cfg = make_config(tmp_path, make_target(tmp_path / "t"), make_data(tmp_path / "d"),
                      run__max_steps=6)
    path = tmp_path / "config.yaml"
    save_config(cfg, path)
    engine = Engine(config_path=path)
    logs: list[str] = []
    engine.bus.tap(lambda e: logs.append(e.message) if isinstance(e, Log) else None)
    app = DFlashApp(engine)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: "FINISHED" in header(app), timeout=60)
        raw = yaml.safe_load(path.read_text())
        raw["data"]["token_budgte"] = 512  # the operator's typo
        path.write_text(yaml.safe_dump(raw))
        await pilot.press("r")
        await pilot.press("y")
        errors = app.query_one("#errors")
        await wait_for(pilot, lambda: "FAILED" in header(app), timeout=30)
        await wait_for(pilot, lambda: errors.table.row_count >= 1, timeout=5)
        assert "data.token_budgte" in errors.detail_text and "token_budget" in errors.detail_text
        assert app.is_running
        del raw["data"]["token_budgte"]  # fixed, and allowed to train further
        raw["run"]["max_steps"] = 9
        path.write_text(yaml.safe_dump(raw))
        await pilot.press("r")
        await pilot.press("y")
        await wait_for(pilot, lambda: "FINISHED" in header(app) and "step 9" in header(app),
                       timeout=60)
    engine.shutdown(10)
    assert any("resuming from" in m and "step 6" in m for m in logs)
