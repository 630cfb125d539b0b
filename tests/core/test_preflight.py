"""Preflight: what is checked before any weight loads, and what it hands the run."""

import pytest
import torch

from dflash_core import demo, events
from dflash_core.config import ConfigError
from dflash_core.memory import plan_memory
from dflash_core.preflight import check_memory, prepare, resolve_devices
from dflash_core.units import GiB

from .test_memory import GPU96, QWEN36_27B, node


# --------------------------------------------------------------------------------------------
# Builtin paths
# --------------------------------------------------------------------------------------------

def test_builtin_paths_resolve_to_the_installed_demo_target_and_its_data(demo_data, tmp_path):
    cfg = demo.demo_config(output_dir=str(tmp_path / "runs"), name="d")
    cfg.run_dir.mkdir(parents=True)
    tdev, ddev = resolve_devices(cfg)
    # DFLASH_CACHE points at the session's cache
    prepared = prepare(cfg, cfg.run_dir, tdev, ddev, publish=lambda event: None,
                       demo_progress=lambda what: None)
    target = prepared.target_path
    assert target == cfg.run_dir / "target" and (target / "config.json").is_file()
    assert prepared.dataset.path == demo_data


# --------------------------------------------------------------------------------------------
# The memory plan
# --------------------------------------------------------------------------------------------

def test_plan_event_round_trips(monkeypatch):
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (96 * GiB, 96 * GiB))
    cfg = node()
    published = []
    with pytest.raises(ConfigError):
        check_memory(cfg, QWEN36_27B, [torch.device(f"cuda:{i}") for i in range(7)],
                     [torch.device("cuda:7")], published.append)
    (event,) = published
    assert isinstance(event, events.MemoryPlan) and event.fits is False
    back = events.from_json(event.to_json())
    assert back.rows == plan_memory(cfg, QWEN36_27B, GPU96, GPU96).to_event_rows()
    row = back.rows[0]
    assert set(row) >= {"device", "role", "components", "total", "free", "fits"}
    assert row["total"] == sum(row["components"].values())
