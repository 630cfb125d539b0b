import subprocess
import threading
import time
import sys
from types import SimpleNamespace

import pytest

from dflash_core.observe.bus import EventBus
from dflash_core.config import ConfigError, WandbConfig
from dflash_core.observe.events import (
    Error, EvalResult, Log, RunEnded, RunStarted, SinkStatus, StepMetrics,
)
from dflash_core.observe.sinks.wandb_sink import WandbSink, validate_wandb_settings


def _step(i):
    return StepMetrics(step=i, epoch=0, loss=2.0, lr=1e-3, grad_norm=1.0, tokens_per_s=10.0,
                       samples_per_s=1.0, tau_tf=1.2)


@pytest.fixture
def offline_env(tmp_path, monkeypatch):
    # Nothing leaves the machine and nothing is written outside tmp_path.
    for var, value in {"WANDB_MODE": "offline", "WANDB_SILENT": "true",
                       "WANDB_DIR": tmp_path / "wandb-env", "WANDB_CONFIG_DIR": tmp_path / "cfg",
                       "WANDB_CACHE_DIR": tmp_path / "cache", "WANDB_DATA_DIR": tmp_path / "data",
                       "WANDB_DISABLE_CODE": "true", "WANDB_DISABLE_GIT": "true"}.items():
        monkeypatch.setenv(var, str(value))
    return tmp_path


# ---------------------------------------------------------------- preflight validation

def test_legacy_private_key_names_public_replacement():
    with pytest.raises(ConfigError) as err:
        validate_wandb_settings({"_stats_sample_rate_seconds": 5})
    assert err.value.key == "wandb.settings._stats_sample_rate_seconds"
    assert "x_stats_sampling_interval" in str(err.value)
    assert "x_stats_sampling_interval" in err.value.hint


def test_removed_and_unknown_keys():
    with pytest.raises(ConfigError) as err:
        validate_wandb_settings({"_stats_samples_to_average": 3})
    assert "removed" in str(err.value) and "delete" in err.value.hint
    with pytest.raises(ConfigError, match="x_disable_stats"):
        validate_wandb_settings({"_disable_stats": True})
    with pytest.raises(ConfigError, match="did you mean 'console'"):
        validate_wandb_settings({"consol": "off"})


def test_bad_values_and_good_settings():
    with pytest.raises(ConfigError) as err:
        validate_wandb_settings({"x_stats_sampling_interval": 0.01})
    assert err.value.key == "wandb.settings.x_stats_sampling_interval"
    with pytest.raises(ConfigError) as err:
        validate_wandb_settings({"console": "loud"})
    assert err.value.key == "wandb.settings.console"
    validate_wandb_settings({"x_stats_sampling_interval": 5.0, "console": "off"})
    validate_wandb_settings({})


def test_module_import_does_not_import_wandb():
    code = ("import sys, dflash_core.observe.sinks.wandb_sink, dflash_core.observe.sinks; "
            "sys.exit('wandb' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


# ---------------------------------------------------------------- the sink, real wandb offline

def test_offline_run_folder_named_in_sink_status(offline_env):
    run_dir = offline_env / "runs" / "demo"
    cfg = WandbConfig(enabled=True, mode="offline", settings={"x_stats_sampling_interval": 5.0})
    bus = EventBus()
    seen = []
    bus.tap(seen.append)
    sink = WandbSink(cfg, run_dir, "demo", {"lr": 1e-3}, bus.publish)
    sub = bus.subscribe("wandb", sink)  # init happens in the bus thread, as in a run
    bus.publish(RunStarted(run_name="demo", run_dir=str(run_dir), config={}, targets=["cpu:0"],
                           drafters=["cpu:0"]))
    for i in range(1, 4):
        bus.publish(_step(i))
    bus.publish(EvalResult(step=3, tau=2.5, acceptance=[1, 2, 3], prompts=4))
    bus.publish(RunEnded(status="finished", step=3, seconds=1.0))
    assert bus.drain(30) and bus.drain(5)
    bus.close()
    sink.close()
    assert not sub.failed and not [ev for ev in seen if isinstance(ev, Error)]
    statuses = [ev for ev in seen if isinstance(ev, SinkStatus)]
    assert [s.status for s in statuses] == ["ok"]
    runs = list((run_dir / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and statuses[0].detail == str(runs[0])
    assert list(runs[0].glob("run-*.wandb"))
    assert sink.state == "finished"


def test_init_failure_is_one_nonfatal_error(offline_env, monkeypatch):
    import wandb

    def broken_init(*args, **kwargs):
        raise RuntimeError("no wandb today")

    monkeypatch.setattr(wandb, "init", broken_init)
    bus = EventBus()
    seen = []
    bus.tap(seen.append)
    sink = WandbSink(WandbConfig(enabled=True), offline_env / "run", "r", {}, bus.publish)
    sub = bus.subscribe("wandb", sink)
    for ev in (_step(1), _step(2), EvalResult(step=2, tau=1.0, acceptance=[1], prompts=1),
               RunEnded(status="finished", step=2, seconds=1.0)):
        bus.publish(ev)
    assert bus.drain(10) and bus.drain(10)  # twice: the sink's own reports go round once more
    bus.close()
    sink.close()
    errors = [ev for ev in seen if isinstance(ev, Error)]
    assert len(errors) == 1
    err = errors[0]
    assert (err.error_kind, err.source, err.fatal) == ("wandb", "sink:wandb", False)
    assert "no wandb today" in err.message and err.hint
    assert [ev.status for ev in seen if isinstance(ev, SinkStatus)] == ["failed"]
    assert not sub.failed  # the sink never raised into the bus
    assert sink.state == "failed"


# ---------------------------------------------------------------- the sink, fake wandb

class FakeRun:
    def __init__(self, fail_log_at=None):
        self.logged = []
        self.summary = {}
        self.finished = None
        self.dir = "/fake/wandb/offline-run-x/files"
        self.url = None
        self.fail_log_at = fail_log_at

    def log(self, data, step):
        if step == self.fail_log_at:
            raise OSError("disk full")
        self.logged.append((step, data))

    def finish(self, exit_code=None):
        self.finished = exit_code


def fake_wandb(run):
    calls = []

    def init(**kwargs):
        calls.append(kwargs)
        return run

    return SimpleNamespace(Settings=lambda **kw: dict(kw), init=init, calls=calls)


def test_logs_steps_eval_and_finishes(tmp_path):
    run = FakeRun()
    wb = fake_wandb(run)
    out = []
    sink = WandbSink(WandbConfig(enabled=True, settings={"console": "wrap"}), tmp_path, "r",
                     {"a": 1}, out.append, wandb_module=wb)
    for ev in (_step(1), _step(2), EvalResult(step=2, tau=3.0, acceptance=[1, 3], prompts=2,
                                              tau_tf_target=3.25, agreement=0.5),
               RunEnded(status="aborted", step=2, seconds=1.0), _step(3)):
        sink(ev)
    (kwargs,) = wb.calls
    assert kwargs["mode"] == "offline" and kwargs["reinit"] == "finish_previous"
    assert kwargs["dir"] == str(tmp_path) and kwargs["config"] == {"a": 1}
    assert kwargs["settings"]["console"] == "wrap"  # the operator's explicit choice wins
    assert [s for s, _ in run.logged] == [1, 2, 2]
    assert run.logged[0][1]["train/loss"] == 2.0
    assert run.logged[2][1]["eval/tau"] == 3.0 and run.logged[2][1]["eval/accept_1"] == 0.75
    assert run.logged[2][1]["eval/tau_tf_target"] == 3.25 and run.logged[2][1]["eval/agreement"] == 0.5
    assert run.logged[2][1]["eval/accepted_at_1"] == 0.75
    assert "eval/tau_tf_heldout" not in run.logged[2][1]  # not measured: left out, not -1
    assert run.finished == 1 and run.summary["status"] == "aborted"
    assert out == [SinkStatus(sink="wandb", status="ok", detail="/fake/wandb/offline-run-x",
                              ts=out[0].ts)]


def test_log_failure_disables_sink(tmp_path):
    run = FakeRun(fail_log_at=2)
    out = []
    sink = WandbSink(WandbConfig(enabled=True), tmp_path, "r", {}, out.append,
                     wandb_module=fake_wandb(run))
    for i in range(1, 6):
        sink(_step(i))
    sink.close()
    assert [s for s, _ in run.logged] == [1]
    assert [type(ev).__name__ for ev in out] == ["SinkStatus", "Error", "SinkStatus"]
    assert out[1].error_kind == "wandb" and not out[1].fatal and out[2].status == "failed"
    assert run.finished is None  # a broken wandb is not touched again


def test_online_without_credentials_fails_before_init(tmp_path):
    wb = fake_wandb(FakeRun())
    wb.run = None
    wb.login = lambda prompt=True, verify=True: False
    out = []
    sink = WandbSink(WandbConfig(enabled=True, mode="online"), tmp_path, "r", {}, out.append,
                     wandb_module=wb)
    sink(_step(1))
    sink(_step(2))
    assert wb.calls == []  # never reached init, which would prompt for a key or hang
    assert [type(ev).__name__ for ev in out] == ["Error", "SinkStatus"]
    assert "credentials" in out[0].message and "wandb.mode: offline" in out[0].hint


def test_disabled_does_not_touch_wandb(tmp_path):
    out = []
    sink = WandbSink(WandbConfig(enabled=False), tmp_path, "r", {}, out.append,
                     wandb_module=object())  # any use of it would raise AttributeError
    sink(_step(1))
    sink(RunEnded(status="finished", step=1, seconds=1.0))
    sink.close()
    assert [(ev.sink, ev.status) for ev in out] == [("wandb", "disabled")]


def test_a_finish_that_hangs_is_bounded_and_said(tmp_path, monkeypatch):
    import dflash_core.observe.sinks.wandb_sink as mod

    monkeypatch.setattr(mod, "FINISH_TIMEOUT_S", 0.6)
    monkeypatch.setattr(mod, "FINISH_NOTICE_S", 0.2)
    release = threading.Event()

    class HungRun(FakeRun):
        def finish(self, exit_code=None):  # online with no network: uploads retried for minutes
            release.wait(30)

    out = []
    sink = WandbSink(WandbConfig(enabled=True, mode="online"), tmp_path, "r", {}, out.append,
                     wandb_module=fake_wandb(HungRun()))
    monkeypatch.setattr(mod, "_require_credentials", lambda wandb: None)
    sink(_step(1))
    t = time.monotonic()
    sink(RunEnded(status="finished", step=1, seconds=1.0))
    assert time.monotonic() - t < 3
    logs = [e for e in out if isinstance(e, Log)]
    assert "waiting up to 1 s for wandb to upload to wandb" in logs[0].message
    assert logs[1].level == "warning" and "wandb sync" in logs[1].message
    release.set()


def test_wandb_banners_are_off_unless_asked_for(tmp_path):
    wb = fake_wandb(FakeRun())
    sink = WandbSink(WandbConfig(enabled=True), tmp_path, "r", {}, [].append, wandb_module=wb)
    sink(_step(1))
    assert wb.calls[0]["settings"]["silent"] is True


def test_device_hours_go_to_cost_keys_at_the_latest_step(tmp_path):
    from dflash_core.observe.events import DeviceHours

    run = FakeRun()
    sink = WandbSink(WandbConfig(enabled=True), tmp_path, "r", {}, [].append,
                     wandb_module=fake_wandb(run))
    sink(_step(5))
    # taken by the engine's thread between steps 4 and 5: logged at 5, never below it
    sink(DeviceHours(step=4, gpu_target=1.0, gpu_drafter=3.0, price=2.0, currency="USD"))
    sink(DeviceHours(step=6, host_target=0.5, host_drafter=0.5, price=2.0, currency="USD"))
    (s1, d1), (s2, d2) = run.logged[1:]
    assert s1 == 5 and d1 == {"cost/gpu_hours": 4.0, "cost/gpu_hours_target": 1.0,
                              "cost/gpu_hours_drafter": 3.0, "cost/money": 8.0}
    # a CPU run: host-hours, no money (the price is per GPU-hour)
    assert s2 == 6 and d2["cost/host_hours"] == 1.0 and d2["cost/gpu_hours"] == 0.0
    assert "cost/money" not in d2
