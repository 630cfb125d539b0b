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

def check_node_on_96gib_cards(monkeypatch, cfg) -> tuple[list, ConfigError | None]:
    """(what check_memory published, what it raised) for the real node's layout."""
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (96 * GiB, 96 * GiB))
    published = []
    try:
        check_memory(cfg, QWEN36_27B, [torch.device(f"cuda:{i}") for i in range(7)],
                     [torch.device("cuda:7")], published.append)
    except ConfigError as exc:
        return published, exc
    return published, None


def test_a_plan_that_does_not_fit_is_refused_naming_the_key_it_picks(monkeypatch):
    published, err = check_node_on_96gib_cards(monkeypatch, node())
    assert err is not None and err.error_kind == "config"
    assert err.key == "drafter.micro_block_tokens"
    assert "the memory plan does not fit:" in str(err) and "plan does NOT fit" in str(err)
    assert err.hint.startswith("cuda:7 (drafter) needs 270.5 GiB but has 96.0 GiB free: "
                               "lower drafter.micro_block_tokens (now 65536)")
    # one sequence per drafter pass fits: nothing is refused
    published, err = check_node_on_96gib_cards(monkeypatch, node(micro_block_tokens=8192))
    assert err is None and published[0].fits


def test_plan_event_round_trips(monkeypatch):
    cfg = node()
    published, err = check_node_on_96gib_cards(monkeypatch, cfg)
    assert err is not None
    (event,) = published
    assert isinstance(event, events.MemoryPlan) and event.fits is False
    back = events.from_json(event.to_json())
    assert back.rows == plan_memory(cfg, QWEN36_27B, GPU96, GPU96).to_event_rows()
    row = back.rows[0]
    assert set(row) >= {"device", "role", "components", "total", "free", "fits"}
    assert row["total"] == sum(row["components"].values())
