"""GPU and host sampling on its own thread: NVML (nvidia-ml-py) + psutil, published as events.

Without NVML (no driver, no pynvml, init error) the sampler reports host memory and CPU only, and
says once, at info level, that GPU telemetry is off and why. A single NVML metric that fails
mid-run reads -1 ("unknown") instead of stopping the sampler. Anything else unexpected is
published as a non-fatal internal Error and the thread ends: telemetry never takes a run down.
"""

from __future__ import annotations

import os
import sys
import threading
from types import ModuleType
from typing import Any, Callable

import psutil

from dflash_core.observe.errors import error_from_exception
from dflash_core.observe.events import Event, GpuSample, HostSample, Log
from dflash_core.units import GiB

# Host memory use (share of RAM) at which the sampler warns, and below which it may warn again.
HOST_MEMORY_WARN = 0.90
HOST_MEMORY_CLEAR = 0.85

SOURCE = "telemetry"
UNKNOWN = -1


class TelemetrySampler(threading.Thread):
    """Publishes one GpuSample per visible GPU and one HostSample every ``interval_s``.

    ``roles`` maps a torch device index to its role ("target", "drafter", "target+drafter").
    ``nvml`` replaces the pynvml module (tests pass a fake); None imports pynvml.
    """

    def __init__(self, publish: Callable[[Event], None], interval_s: float,
                 roles: dict[int, str], stop: threading.Event, *, nvml: ModuleType | None = None,
                 raise_errors: bool = False, limits: dict[int, int] | None = None,
                 beat: Callable[[str], None] | None = None):
        super().__init__(name=SOURCE, daemon=True)  # daemon: never keeps the process alive
        self.publish = publish
        self.interval_s = interval_s
        self.roles = dict(roles)
        self.limits = dict(limits or {})  # GPU index -> bytes the process may use there
        self._beat = beat or (lambda phase: None)  # each round is progress (stall watchdog)
        self.stop = stop
        self._nvml = nvml
        # The engine runs the sampler inside its own guarded worker and wants a crash raised
        # (classified and fatal like any worker's); standalone, it is reported and ends quietly.
        self.raise_errors = raise_errors
        self._handles: list[tuple[int, Any]] = []  # (torch index, NVML handle)
        self._failed_metrics: set[str] = set()
        self._process = psutil.Process()
        self._host_warned = False
        psutil.cpu_percent(interval=None)  # prime: the first sample then measures since now

    # -- lifecycle ---------------------------------------------------------------------------

    def run(self) -> None:
        try:
            self._start_nvml()
            while not self.stop.is_set():
                self._beat("sampling")
                self.sample_once()
                if self.stop.wait(self.interval_s):
                    break
        except Exception as exc:
            if self.raise_errors:
                raise
            self.publish(error_from_exception(
                exc, error_kind="internal", source=SOURCE, fatal=False,
                hint="GPU and host telemetry stopped; training is not affected"))
        finally:
            self._shutdown_nvml()

    def _start_nvml(self) -> None:
        try:
            nvml = self._nvml
            if nvml is None:
                import pynvml as nvml  # nvidia-ml-py
            nvml.nvmlInit()
            ids = _visible_nvml_ids(nvml)
        except Exception as exc:  # ImportError, NVMLError (no driver / library), anything odd
            self._nvml = None
            self.publish(Log(level="info", source=SOURCE,
                             message=f"GPU telemetry off ({type(exc).__name__}: {exc}); "
                                     "sampling host memory and CPU only"))
            return
        self._nvml = nvml
        # A GPU whose handle fails still gets samples, every metric unknown.
        self._handles = [(i, self._metric("handle", lambda n=n: self._handle(n), None))
                         for i, n in enumerate(ids)]

    def _handle(self, nvml_id: int | str) -> Any:
        nvml = self._nvml
        if isinstance(nvml_id, str):  # CUDA_VISIBLE_DEVICES may name GPUs by UUID
            return nvml.nvmlDeviceGetHandleByUUID(nvml_id)
        return nvml.nvmlDeviceGetHandleByIndex(nvml_id)

    def _shutdown_nvml(self) -> None:
        if self._nvml is not None:
            try:
                self._nvml.nvmlShutdown()
            except Exception:
                pass  # the process is leaving NVML behind either way

    # -- sampling ----------------------------------------------------------------------------

    def _watch_host_memory(self, vm) -> None:
        """One warning when host memory nears its limit (a loader or pinned buffers growing can
        take the node down), naming who holds it; again only after it has come down."""
        used = (vm.total - vm.available) / vm.total if vm.total else 0.0
        if used >= HOST_MEMORY_WARN and not self._host_warned:
            self._host_warned = True
            rss = self._process.memory_info().rss
            self.publish(Log(level="warning", source=SOURCE, message=(
                f"host memory at {used:.0%} of {vm.total / GiB:.0f} GiB: this process holds "
                f"{rss / GiB:.1f} GiB (loader batches, pinned buffers: data.prefetch_batches, "
                f"layout.hs_queue); the largest other process is "
                f"{_largest_other_process(self._process.pid)}")))
        elif used < HOST_MEMORY_CLEAR:
            self._host_warned = False

    def sample_once(self) -> None:
        """Publish one round of samples. Tests replace it to inject failures."""
        for index, handle in self._handles:
            self.publish(self._gpu_sample(index, handle))
        self.publish(self._host_sample())

    def _metric(self, name: str, fn: Callable[[], Any], default: Any = UNKNOWN) -> Any:
        """One NVML call; a failure reads as unknown and is mentioned once per metric."""
        try:
            return fn()
        except Exception as exc:
            if name not in self._failed_metrics:
                self._failed_metrics.add(name)
                self.publish(Log(level="debug", source=SOURCE,
                                 message=f"GPU {name} unavailable ({type(exc).__name__}: {exc});"
                                         " shown as unknown"))
            return default

    def _gpu_sample(self, index: int, handle: Any) -> GpuSample:
        nvml = self._nvml
        name = self._metric("name", lambda: nvml.nvmlDeviceGetName(handle), f"GPU {index}")
        if isinstance(name, bytes):  # older nvidia-ml-py returns bytes
            name = name.decode(errors="replace")
        mem = self._metric("memory", lambda: nvml.nvmlDeviceGetMemoryInfo(handle), None)
        temp_sensor = getattr(nvml, "NVML_TEMPERATURE_GPU", 0)
        allocated, reserved, retries, ooms = _torch_memory(index)
        return GpuSample(
            index=index, name=str(name),
            mem_used=int(mem.used) if mem is not None else UNKNOWN,
            mem_total=int(mem.total) if mem is not None else UNKNOWN,
            util=float(self._metric(
                "utilization", lambda: nvml.nvmlDeviceGetUtilizationRates(handle).gpu)),
            temperature=float(self._metric(
                "temperature", lambda: nvml.nvmlDeviceGetTemperature(handle, temp_sensor))),
            # NVML reports milliwatts
            power=float(self._metric(
                "power", lambda: nvml.nvmlDeviceGetPowerUsage(handle) / 1000.0)),
            torch_allocated=allocated, torch_reserved=reserved,
            role=self.roles.get(index, ""), limit=self.limits.get(index, 0),
            alloc_retries=retries, ooms=ooms,
        )

    def _host_sample(self) -> HostSample:
        vm = psutil.virtual_memory()
        self._watch_host_memory(vm)
        return HostSample(
            # total - available: memory really taken, not counting reclaimable page cache
            ram_used=int(vm.total - vm.available), ram_total=int(vm.total),
            cpu_percent=float(psutil.cpu_percent(interval=None)),
            process_rss=int(self._process.memory_info().rss),
        )


def _largest_other_process(me: int) -> str:
    best = None
    for p in psutil.process_iter(["pid", "name", "memory_info"]):
        mem = p.info.get("memory_info")
        if p.info["pid"] != me and mem is not None and (best is None or mem.rss > best[0]):
            best = (mem.rss, p.info["pid"], p.info.get("name") or "?")
    return f"{best[2]} (pid {best[1]}) {best[0] / GiB:.1f} GiB" if best else "none readable"


def _visible_nvml_ids(nvml: ModuleType) -> list[int | str]:
    """NVML ids of the GPUs torch sees, in torch's order (CUDA_VISIBLE_DEVICES, else all).

    NVML enumerates in PCI bus order; CUDA does too on identical GPUs (set
    CUDA_DEVICE_ORDER=PCI_BUS_ID on mixed nodes to keep the two in step).
    """
    count = nvml.nvmlDeviceGetCount()
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return list(range(count))
    ids: list[int | str] = []
    for item in visible.split(","):
        item = item.strip()
        if not item:
            continue
        if item.isdigit():
            if int(item) >= count:
                break  # CUDA stops at the first invalid id
            ids.append(int(item))
        elif item.startswith("GPU-"):
            ids.append(item)
        else:
            break
    return ids


def _torch_memory(index: int) -> tuple[int, int, int, int]:
    """torch's allocator view of one device (allocated, reserved, retries, OOMs), only if this
    process already initialised CUDA: sampling must never import torch or create a CUDA context
    from this thread."""
    torch = sys.modules.get("torch")
    try:
        if torch is None or not torch.cuda.is_initialized() or index >= torch.cuda.device_count():
            return 0, 0, 0, 0
        stats = torch.cuda.memory_stats(index)
        return (int(stats.get("allocated_bytes.all.current", 0)),
                int(stats.get("reserved_bytes.all.current", 0)),
                int(stats.get("num_alloc_retries", 0)), int(stats.get("num_ooms", 0)))
    except Exception:
        return 0, 0, 0, 0
