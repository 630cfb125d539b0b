"""A run's device time as a figure, in records and in words: what a DeviceHours event says
(events.py), the record a checkpoint keeps of it (training_state.json, ``trainer.device_hours``;
a checkpoint folder's is read by persist/hours_ledger.py for ``dflash-tui eval``), and the words
every reader prints (train.log, the dashboard, the report, eval's table). The meter that counts it: pipeline/hours_meter.py.

GPU-hours are what a user pays for: every GPU the run holds, from the run's start to its end,
split equally among the workers (targets, drafters) on it. A run on the CPU holds the host, not a
GPU: its time is counted as host-hours (the host as one device, not per core) and it has 0
GPU-hours; a price per GPU-hour never applies to it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields

from dflash_core.observe.events import DeviceHours

RECORD_KEY = "device_hours"  # in a checkpoint's trainer state


@dataclass(frozen=True)
class Figure:
    """Device-hours per unit and role, and the price in force when it was taken."""

    gpu_target: float = 0.0
    gpu_drafter: float = 0.0
    host_target: float = 0.0
    host_drafter: float = 0.0
    since_step: int = 0  # counted from this step (0: from the run's start)
    price: float = 0.0  # per GPU-hour (0: none)
    currency: str = ""

    @property
    def gpu(self) -> float:
        return self.gpu_target + self.gpu_drafter

    @property
    def host(self) -> float:
        return self.host_target + self.host_drafter

    @property
    def money(self) -> float | None:
        """GPU-hours at the price in force; None without a price, and for a CPU run (host-hours
        are not priced)."""
        if self.price <= 0 or (self.gpu == 0 and self.host > 0):
            return None
        return self.gpu * self.price

    def record(self) -> dict:
        """What a checkpoint holds of it (plain JSON)."""
        return asdict(self)

    @classmethod
    def from_record(cls, rec) -> Figure | None:
        """The figure a checkpoint recorded; None when it has none (written before checkpoints
        recorded device time) or it cannot be read."""
        if not isinstance(rec, dict):
            return None
        names = {f.name for f in fields(cls)}
        try:
            return cls(**{k: (str(v) if k == "currency" else int(v) if k == "since_step"
                              else float(v)) for k, v in rec.items() if k in names})
        except (TypeError, ValueError):
            return None

    @classmethod
    def of_event(cls, e: DeviceHours) -> Figure:
        return cls(e.gpu_target, e.gpu_drafter, e.host_target, e.host_drafter, e.since_step,
                   e.price, e.currency)


# -- words ----------------------------------------------------------------------------------------

def hours_text(h: float) -> str:
    """Hours with three significant digits (0.0213, 1.23, 12.3), whole past 100 (1,234)."""
    return f"{h:,.0f}" if h >= 100 else f"{h:.3g}"


def money_text(amount: float, currency: str) -> str:
    digits = 4 if 0 < amount < 0.01 else 2
    return f"{amount:,.{digits}f} {currency}".rstrip()


def figure_text(f: Figure, lost_gpu: float = 0.0, lost_host: float = 0.0) -> str:
    """One phrase: '1.23 GPU-hours (target 0.41, drafter 0.82), 3.69 USD at 3 USD/GPU-hour'; a
    CPU run: '0.0213 host-hours on the CPU (target ..., drafter ...; 0 GPU-hours)'. With the
    hours earlier segments held that the figure leaves out, and where the count began."""
    parts = []
    if f.gpu > 0 or f.host == 0:
        text = (f"{hours_text(f.gpu)} GPU-hours (target {hours_text(f.gpu_target)}, "
                f"drafter {hours_text(f.gpu_drafter)})")
        if f.money is not None:
            text += (f", {money_text(f.money, f.currency)} at {f.price:g} {f.currency}"
                     f"/GPU-hour").rstrip()
        parts.append(text)
    if f.host > 0:
        parts.append(f"{hours_text(f.host)} host-hours on the CPU (target "
                     f"{hours_text(f.host_target)}, drafter {hours_text(f.host_drafter)}"
                     + ("; 0 GPU-hours)" if f.gpu == 0 else ")"))
    text = " + ".join(parts)
    lost = [f"{hours_text(h)} {unit}" for h, unit in ((lost_gpu, "GPU-hours"),
                                                     (lost_host, "host-hours")) if h > 0]
    if lost:
        text += f"; {' and '.join(lost)} more held by earlier segments no checkpoint kept"
    if f.since_step:
        text += f"; counted from step {f.since_step} (its checkpoint recorded none)"
    return text


def short_text(f: Figure) -> str:
    """A few cells for the dashboard's header: '1.23 GPU-h 3.69 USD', '0.021 host-h (CPU)'."""
    if f.gpu > 0 or f.host == 0:
        return f"{hours_text(f.gpu)} GPU-h" + (
            f" {money_text(f.money, f.currency)}" if f.money is not None else "")
    return f"{hours_text(f.host)} host-h (CPU)"


def event_line(e: DeviceHours) -> str:
    """train.log's line of an evaluation's or the end's figure."""
    when = {"end": "at the end", "eval": "at the evaluation"}.get(e.reason, f"({e.reason})")
    return (f"device time {when} of step {e.step}: "
            + figure_text(Figure.of_event(e), e.lost_gpu, e.lost_host))


def table_cells(f: Figure | None) -> tuple[str, str]:
    """eval's two rows of a drafter: (GPU-hours, cost); '-' where not known."""
    if f is None:
        return "-", "-"
    hours = hours_text(f.gpu) if f.gpu > 0 or f.host == 0 else f"0 (CPU {hours_text(f.host)} h)"
    return hours, money_text(f.money, f.currency) if f.money is not None else "-"


def wandb_data(e: DeviceHours) -> dict:
    """W&B's cost/* keys of a figure (host-hours only for a CPU run, money only with a price)."""
    f = Figure.of_event(e)
    data = {"cost/gpu_hours": f.gpu, "cost/gpu_hours_target": f.gpu_target,
            "cost/gpu_hours_drafter": f.gpu_drafter}
    if f.host > 0:
        data.update({"cost/host_hours": f.host, "cost/host_hours_target": f.host_target,
                     "cost/host_hours_drafter": f.host_drafter})
    if f.money is not None:
        data["cost/money"] = f.money
    return data
