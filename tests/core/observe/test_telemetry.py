"""Telemetry sampler: CPU-only fallback, a fake NVML with two GPUs, failing metrics, stop and
fault injection."""

from __future__ import annotations

import sys
import threading
import time
from types import SimpleNamespace

import pytest

from dflash_core.observe.events import Error, GpuSample, HostSample, Log
from dflash_core.observe import telemetry
from dflash_core.observe.telemetry import TelemetrySampler

GiB = 1 << 30


class FakeNVMLError(Exception):
    pass


class FakeNVML:
    """Just the pynvml calls the sampler makes, for ``gpus`` devices."""

    NVML_TEMPERATURE_GPU = 0
    NVMLError = FakeNVMLError

    def __init__(self, gpus=2, init_error=None, failing=()):
        self.gpus = gpus
        self.init_error = init_error
        self.failing = set(failing)  # names of methods that raise
        self.shutdowns = 0

    def _check(self, name):
        if name in self.failing:
            raise FakeNVMLError(f"{name}: Not Supported")

    def nvmlInit(self):
        if self.init_error:
            raise self.init_error

    def nvmlShutdown(self):
        self.shutdowns += 1

    def nvmlDeviceGetCount(self):
        return self.gpus

    def nvmlDeviceGetHandleByIndex(self, i):
        assert 0 <= i < self.gpus
        return i

    def nvmlDeviceGetName(self, h):
        self._check("nvmlDeviceGetName")
        return f"Fake H200 #{h}".encode() if h else f"Fake H200 #{h}"  # bytes from old versions

    def nvmlDeviceGetMemoryInfo(self, h):
        self._check("nvmlDeviceGetMemoryInfo")
        return SimpleNamespace(used=(h + 1) * GiB, total=141 * GiB, free=(140 - h) * GiB)

    def nvmlDeviceGetUtilizationRates(self, h):
        self._check("nvmlDeviceGetUtilizationRates")
        return SimpleNamespace(gpu=50 + h, memory=10)

    def nvmlDeviceGetTemperature(self, h, sensor):
        self._check("nvmlDeviceGetTemperature")
        assert sensor == self.NVML_TEMPERATURE_GPU
        return 40 + h

    def nvmlDeviceGetPowerUsage(self, h):
        self._check("nvmlDeviceGetPowerUsage")
        return 300_500 + 1000 * h  # milliwatts


class Collector:
    def __init__(self):
        self.events = []

    def __call__(self, event):
        self.events.append(event)

    def of(self, cls):
        return [e for e in self.events if isinstance(e, cls)]

    def wait_for(self, pred, timeout=3.0):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if pred(self):
                return True
            time.sleep(0.005)
        return False


@pytest.fixture(autouse=True)
def all_gpus_visible(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)


def start(nvml=None, roles=None, interval=0.02):
    out, stop = Collector(), threading.Event()
    sampler = TelemetrySampler(out, interval, roles or {}, stop, nvml=nvml)
    sampler.start()
    return sampler, out, stop


def finish(sampler, stop):
    stop.set()
    sampler.join(1.0)
    assert not sampler.is_alive()


@pytest.mark.parametrize("how", ["init-error", "no-module"])
def test_cpu_only_without_nvml(monkeypatch, how):
    if how == "no-module":
        monkeypatch.setitem(sys.modules, "pynvml", None)  # import pynvml -> ImportError
        nvml = None
    else:
        nvml = FakeNVML(init_error=FakeNVMLError("Driver Not Loaded"))
    sampler, out, stop = start(nvml)
    assert out.wait_for(lambda c: len(c.of(HostSample)) >= 3)  # several rounds, one message
    finish(sampler, stop)
    host = out.of(HostSample)[0]
    assert 0 < host.ram_used <= host.ram_total and host.process_rss > 0
    assert 0 <= host.cpu_percent
    (log,) = out.of(Log)
    assert log.level == "info" and log.source == "telemetry"
    assert "GPU telemetry off" in log.message
    assert ("Driver Not Loaded" if how == "init-error" else "pynvml") in log.message
    assert not out.of(Error) and not out.of(GpuSample)


def test_two_fake_gpus_with_roles():
    nvml = FakeNVML(gpus=2)
    sampler, out, stop = start(nvml, roles={0: "target", 1: "drafter"})
    assert out.wait_for(lambda c: len(c.of(GpuSample)) >= 4)
    finish(sampler, stop)
    first = {s.index: s for s in out.of(GpuSample)[:2]}
    assert first[0] == GpuSample(index=0, name="Fake H200 #0", mem_used=GiB, mem_total=141 * GiB,
                                 util=50.0, temperature=40.0, power=300.5, torch_allocated=0,
                                 torch_reserved=0, role="target", ts=first[0].ts)
    assert first[1].name == "Fake H200 #1"  # bytes decoded
    assert (first[1].mem_used, first[1].util, first[1].temperature, first[1].power,
            first[1].role) == (2 * GiB, 51.0, 41.0, 301.5, "drafter")
    assert out.of(HostSample) and not out.of(Error) and not out.of(Log)
    assert nvml.shutdowns == 1


def test_only_cuda_visible_devices_are_sampled(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    sampler, out, stop = start(FakeNVML(gpus=2), roles={0: "drafter"})
    assert out.wait_for(lambda c: c.of(GpuSample))
    finish(sampler, stop)
    assert {(s.index, s.name, s.role) for s in out.of(GpuSample)} == {(0, "Fake H200 #1",
                                                                        "drafter")}


def test_a_failing_metric_reads_minus_one():
    nvml = FakeNVML(gpus=1, failing={"nvmlDeviceGetTemperature", "nvmlDeviceGetMemoryInfo"})
    sampler, out, stop = start(nvml)
    assert out.wait_for(lambda c: len(c.of(GpuSample)) >= 3)
    finish(sampler, stop)
    for s in out.of(GpuSample):
        assert (s.temperature, s.mem_used, s.mem_total) == (-1.0, -1, -1)
        assert (s.util, s.power) == (50.0, 300.5)
    # said once per metric, at debug level, never as an error
    assert sorted(log.message.split()[1] for log in out.of(Log)) == ["memory", "temperature"]
    assert all(log.level == "debug" for log in out.of(Log))
    assert not out.of(Error)


def test_stop_ends_the_thread_within_one_second():
    sampler, out, stop = start(FakeNVML(), interval=30.0)
    assert out.wait_for(lambda c: c.of(HostSample))
    t0 = time.monotonic()
    finish(sampler, stop)
    assert time.monotonic() - t0 < 1.0


def test_an_unexpected_exception_is_a_non_fatal_error_and_ends_the_thread():
    out, stop = Collector(), threading.Event()
    sampler = TelemetrySampler(out, 0.01, {}, stop, nvml=FakeNVML())
    calls = []

    def boom():
        calls.append(1)
        raise RuntimeError("injected")

    sampler.sample_once = boom
    sampler.start()
    sampler.join(1.0)
    assert not sampler.is_alive() and not stop.is_set()  # ended by itself
    (err,) = out.of(Error)
    assert (err.error_kind, err.source, err.fatal) == ("internal", "telemetry", False)
    assert "RuntimeError: injected" in err.message and "injected" in err.traceback
    assert calls == [1]


def test_raise_errors_hands_the_crash_to_the_caller_instead_of_reporting_it():
    out, stop = Collector(), threading.Event()
    sampler = TelemetrySampler(out, 0.01, {}, stop, nvml=FakeNVML(), raise_errors=True)

    def boom():
        raise RuntimeError("injected")

    sampler.sample_once = boom
    with pytest.raises(RuntimeError, match="injected"):
        sampler.run()  # the engine calls run() inside its guarded worker thread
    assert out.of(Error) == []


def test_samples_carry_the_card_limit_the_engine_set():
    nvml = FakeNVML(gpus=2)
    out, stop = Collector(), threading.Event()
    sampler = TelemetrySampler(out, 0.05, {0: "target", 1: "drafter"}, stop, nvml=nvml,
                               limits={1: 95 * GiB})
    sampler.start()
    assert out.wait_for(lambda c: len(c.of(GpuSample)) >= 2)
    finish(sampler, stop)
    first = {s.index: s for s in out.of(GpuSample)[:2]}
    assert (first[0].limit, first[1].limit) == (0, 95 * GiB)
    # no CUDA in this process: the allocator's counters read zero rather than start CUDA
    assert (first[1].alloc_retries, first[1].ooms, first[1].torch_reserved) == (0, 0, 0)


def test_host_memory_near_its_limit_is_one_warning_naming_who_holds_it(monkeypatch):
    total = 64 * GiB
    used = [0.5]

    def vm():
        return SimpleNamespace(total=total, available=int(total * (1 - used[0])))

    monkeypatch.setattr(telemetry.psutil, "virtual_memory", vm)
    out, stop = Collector(), threading.Event()
    sampler = TelemetrySampler(out, 0.01, {}, stop, nvml=FakeNVML(gpus=0))
    sampler._host_sample()
    used[0] = 0.93
    sampler._host_sample()
    sampler._host_sample()
    (warn,) = [e for e in out.of(Log) if e.level == "warning"]
    assert "host memory at 93% of 64 GiB" in warn.message
    assert "this process holds" in warn.message and "largest other process" in warn.message
    used[0] = 0.5
    sampler._host_sample()
    used[0] = 0.95
    sampler._host_sample()
    assert len([e for e in out.of(Log) if e.level == "warning"]) == 2  # again after recovering
