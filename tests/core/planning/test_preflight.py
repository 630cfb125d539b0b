"""Preflight: what is checked before any weight loads, and what it hands the run."""

import shutil

import numpy as np
import pytest
import torch

from dflash_core import demo

from dflash_core.observe import events
from dflash_core.config import ConfigError
from dflash_core.pipeline.engine import Engine
from dflash_core.observe.events import Error, LoadProgress, Log, MemoryPlan, WorkerStatus, read_jsonl
from dflash_core.planning.memory import plan_memory
from dflash_core.planning.preflight import check_memory, prepare, resolve_devices
from dflash_core.units import GiB

from ..engine_fixtures import (  # noqa: F401 - assets, shutdown_started_engines: fixtures
    assets, ended, long_config, make_config, run_to_end, shutdown_started_engines, started,
    wait_gone,
)
from ..planning.test_memory import GPU96, QWEN36_27B, node


# --------------------------------------------------------------------------------------------
# Refused at preflight, before any weights load
# --------------------------------------------------------------------------------------------

def refused(cfg) -> Error:
    engine, rec, before = started(cfg)
    end = ended(engine, rec)
    assert end.status == "failed"
    assert rec.states() == ["preflight", "failed"]
    assert not rec.of(LoadProgress)
    assert not [w for w in rec.of(WorkerStatus) if w.role == "target"]
    assert wait_gone(before) == []
    (err,) = [e for e in rec.of(Error) if e.fatal]
    assert err.phase == "preflight"
    return err


def test_missing_model_folder_is_a_config_error_before_loading(tmp_path, assets):
    cfg = long_config(tmp_path, assets, target__path=str(tmp_path / "no-such-model"))
    err = refused(cfg)
    assert err.error_kind == "config"
    assert "no-such-model" in err.message and "target.path" in err.hint


def test_corrupt_shard_is_a_data_error_naming_the_file(tmp_path, assets):
    target, data = assets
    broken = shutil.copytree(data, tmp_path / "data")
    shard = sorted(broken.glob("data-*.arrow"))[0]
    shard.write_bytes(np.random.default_rng(0).bytes(4096))
    cfg = long_config(tmp_path, assets, data__path=str(broken))
    err = refused(cfg)
    assert err.error_kind == "data"
    assert shard.name in err.message


def test_legacy_wandb_setting_is_refused_naming_its_replacement(tmp_path, assets):
    cfg = long_config(tmp_path, assets, wandb__enabled=True, wandb__mode="offline",
                      wandb__settings={"_stats_sample_rate_seconds": 1})
    err = refused(cfg)
    assert err.error_kind == "config"
    assert "_stats_sample_rate_seconds" in err.message
    assert "x_stats_sampling_interval" in err.message + err.hint
    # the wandb sink never started: no wandb traceback in front of the clear error
    events = read_jsonl(cfg.run_dir / "events.jsonl")
    assert [e.source for e in events if isinstance(e, Error)] == ["engine"]


def test_too_many_features_for_a_shallow_target_is_refused_at_preflight(tmp_path, assets):
    target, data = assets  # 6 layers: 5 features spread over layers 1..3 would repeat layers
    cfg = make_config(tmp_path, target, data, target__num_features=5)
    engine = Engine(cfg)
    rec = run_to_end(engine)
    engine.shutdown()
    (err,) = rec.of(Error)
    assert err.error_kind == "config" and "target.layer_ids" in err.message and "repeats" in err.message
    assert "target.num_features" in err.hint
    assert not rec.of(LoadProgress)


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
    assert err.hint.startswith("cuda:7 (drafter) needs 252.8 GiB but has 96.0 GiB free: "
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


def _fake_gpus(monkeypatch, free_gib: float):
    """Preflight sees CUDA devices with ``free_gib`` free (no GPU needed to plan)."""
    monkeypatch.setattr(torch.cuda, "mem_get_info",
                        lambda d=None: (int(free_gib * GiB), int(free_gib * GiB)))
    return [torch.device("cuda", i) for i in range(2)], [torch.device("cuda", i) for i in range(2, 8)]


def test_plan_that_does_not_fit_names_the_sizes_that_would(monkeypatch):

    tdev, ddev = _fake_gpus(monkeypatch, 96)
    cfg = node(micro_block_tokens=65536)
    cfg.layout.targets, cfg.layout.drafters = [0, 1], [2, 3, 4, 5, 6, 7]
    with pytest.raises(ConfigError) as info:
        check_memory(cfg, QWEN36_27B, tdev, ddev, lambda e: None)
    assert info.value.key == "drafter.micro_block_tokens"
    assert "these sizes fit: drafter.micro_block_tokens: 8192" in info.value.hint
    assert "layout.auto_fit: true" in info.value.hint


def test_auto_fit_lowers_the_sizes_and_says_so(monkeypatch):

    tdev, ddev = _fake_gpus(monkeypatch, 95)  # a 96 GB card offers ~95.6 GiB; rehearsed at 95
    cfg = node(micro_block_tokens=32768)
    cfg.layout.targets, cfg.layout.drafters, cfg.layout.auto_fit = [0, 1], [2, 3, 4, 5, 6, 7], True
    events = []
    assert check_memory(cfg, QWEN36_27B, tdev, ddev, events.append) == {
        "drafter.micro_block_tokens": 8192}
    assert cfg.drafter.micro_block_tokens == 8192
    (log,) = [e for e in events if isinstance(e, Log)]
    assert "drafter.micro_block_tokens 32768 -> 8192" in log.message and log.level == "warning"
    (plan,) = [e for e in events if isinstance(e, MemoryPlan)]
    assert plan.fits
