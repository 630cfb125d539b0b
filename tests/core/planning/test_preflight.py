"""Preflight: what is checked before any weight loads, and what it hands the run."""

import shutil

import numpy as np

from dflash_core import demo

from dflash_core.observe.event_log import read_events
from dflash_core.pipeline.engine import Engine
from dflash_core.observe.events import Error, LoadProgress, WorkerStatus
from dflash_core.planning.preflight import prepare, resolve_devices

from ..engine_fixtures import (  # noqa: F401 - assets, shutdown_started_engines: fixtures
    assets, ended, long_config, make_config, run_to_end, shutdown_started_engines, started,
    wait_gone,
)


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
    events = read_events(cfg.run_dir / "events.jsonl")
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
