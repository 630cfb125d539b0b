"""The run's device time, counted as a user pays for it (observe/device_hours.py says it in
words; docs/eval.md, "Cost").

- Every device the run holds counts wall time from the run's start (the engine's start of it,
  before its preflight) to its end (after its teardown): loading, warm-up, evaluations and
  checkpoint writes are paid for as training is.
- A device's time is split equally among the workers on it: a GPU with one target and one
  drafter gives each role half its hours. A GPU is one CUDA index; on the CPU every worker runs
  on the host, which counts as ONE device in host-hours (not GPU-hours, not per core).
- Several nodes run the same layout on their own devices and start and end each run together,
  so each node counts its own devices times the number of nodes: every node's figure is the
  run's.
- Across resumes: a checkpoint records the figure when it was written and a resume goes on
  from it; time a segment held after its last checkpoint is not in that figure, and the run
  folder's device_hours.json (persist/hours_ledger.py) says how much was held that way
  (``lost``). A checkpoint written before figures were recorded resumes counting from its step
  (``since_step``).
"""

from __future__ import annotations

import time
from typing import Callable, Iterable

from dflash_core.observe.device_hours import Figure
from dflash_core.observe.events import DeviceHours

PERIOD_S = 30.0  # a DeviceHours event at least this often while the run lives


def role_devices(target_devices: Iterable, drafter_devices: Iterable) -> Figure:
    """Devices per unit and role (a Figure of devices, not hours): each device held counts once,
    split equally among the workers on it. ``*_devices``: one torch.device (or "cuda:3" / "cpu")
    per worker, as the run resolved them."""
    per: dict[str, list[int]] = {}  # device key -> [targets, drafters] on it
    for role, devices in ((0, target_devices), (1, drafter_devices)):
        for d in devices:
            text = str(d)
            key = text if text.startswith("cuda") else "cpu"  # every CPU worker: the host
            per.setdefault(key, [0, 0])[role] += 1
    gpu_t = gpu_d = host_t = host_d = 0.0
    for key, (t, d) in per.items():
        share_t, share_d = t / (t + d), d / (t + d)
        if key == "cpu":
            host_t, host_d = host_t + share_t, host_d + share_d
        else:
            gpu_t, gpu_d = gpu_t + share_t, gpu_d + share_d
    return Figure(gpu_t, gpu_d, host_t, host_d)


class HoursMeter:
    """One per run, made once its devices are known. ``started_at``: the run's start on
    ``clock`` (monotonic seconds; injected in tests); ``held_before``: (GPU-hours, host-hours)
    earlier segments of this run folder held (its device_hours.json)."""

    def __init__(self, target_devices, drafter_devices, *, started_at: float, nodes: int = 1,
                 price: float = 0.0, currency: str = "",
                 held_before: tuple[float, float] = (0.0, 0.0),
                 clock: Callable[[], float] = time.monotonic):
        rate = role_devices(target_devices, drafter_devices)
        self.rate = Figure(rate.gpu_target * nodes, rate.gpu_drafter * nodes,
                           rate.host_target * nodes, rate.host_drafter * nodes)
        self.started_at, self.clock = started_at, clock
        self.price, self.currency = price, currency
        self.held_before = held_before
        self.carried = Figure()  # the resumed checkpoint's figure
        self._last_event: float | None = None

    @property
    def devices(self) -> int:
        return round(self.rate.gpu + self.rate.host)

    def resume_from(self, record, step: int) -> bool:
        """Go on from a checkpoint's recorded figure (``record``: its trainer state's
        device_hours); a checkpoint without one starts the count at its ``step``. True when it
        had one."""
        got = Figure.from_record(record)
        self.carried = got if got is not None else Figure(since_step=step)
        return got is not None

    def figure(self) -> Figure:
        """The hours to now: the resumed figure plus this segment's."""
        h = max(0.0, self.clock() - self.started_at) / 3600.0
        c, r = self.carried, self.rate
        return Figure(c.gpu_target + r.gpu_target * h, c.gpu_drafter + r.gpu_drafter * h,
                      c.host_target + r.host_target * h, c.host_drafter + r.host_drafter * h,
                      c.since_step, self.price, self.currency)

    def lost(self) -> tuple[float, float]:
        """(GPU-hours, host-hours) earlier segments held that the resumed figure leaves out."""
        c = self.carried
        return (max(0.0, self.held_before[0] - c.gpu), max(0.0, self.held_before[1] - c.host))

    def held(self) -> tuple[float, float]:
        """(GPU-hours, host-hours) the run folder's segments held, this one to now included:
        what its device_hours.json records."""
        f, (lg, lh) = self.figure(), self.lost()
        return f.gpu + lg, f.host + lh

    def due(self) -> bool:
        """A periodic event is due (PERIOD_S since the last one)."""
        return self._last_event is None or self.clock() - self._last_event >= PERIOD_S

    def event(self, step: int, reason: str = "periodic") -> DeviceHours:
        self._last_event = self.clock()
        f, (lost_gpu, lost_host) = self.figure(), self.lost()
        return DeviceHours(step=step, gpu_target=f.gpu_target, gpu_drafter=f.gpu_drafter,
                           host_target=f.host_target, host_drafter=f.host_drafter,
                           lost_gpu=lost_gpu, lost_host=lost_host, devices=self.devices,
                           price=self.price, currency=self.currency, reason=reason,
                           since_step=f.since_step)
