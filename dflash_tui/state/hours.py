"""The device time on the dashboard: the run's last DeviceHours figure (dashboard.py keeps it),
moved on with the clock while the run lives (the devices go on being held at the figure's
rate), in the header's few cells: GPU-hours and money with a price, host-hours for a CPU run."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from dflash_core.observe.device_hours import Figure, short_text

if TYPE_CHECKING:
    from .dashboard import DashboardState


def hours_now(s: DashboardState) -> Figure | None:
    """The figure now: the last one, plus its devices' hours since it was taken while the run
    lives (its roles' split is the last figure's). None before any figure."""
    e = s.hours
    if e is None:
        return None
    f = Figure.of_event(e)
    since = max(0.0, s.now - e.ts) / 3600.0 if s.live else 0.0
    more = since * e.devices
    if not more:
        return f
    if f.gpu > 0 or f.host == 0:
        share = f.gpu_target / f.gpu if f.gpu > 0 else 0.5
        return replace(f, gpu_target=f.gpu_target + more * share,
                       gpu_drafter=f.gpu_drafter + more * (1 - share))
    share = f.host_target / f.host
    return replace(f, host_target=f.host_target + more * share,
                   host_drafter=f.host_drafter + more * (1 - share))


def header_text(s: DashboardState) -> str:
    """'1.23 GPU-h 3.69 USD', '0.021 host-h (CPU)'; '' before any figure."""
    f = hours_now(s)
    return short_text(f) if f is not None else ""
