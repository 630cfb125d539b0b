"""The subscribers one run writes to: events.jsonl and train.log (critical: a lost record stops
the run) and, when enabled, wandb (best effort)."""

from __future__ import annotations

from pathlib import Path

from dflash_core.config import Config
from dflash_core.observe.event_log import EVENTS_FILE
from dflash_core.observe.sinks.jsonl import JsonlSink
from dflash_core.observe.sinks.textlog import TextLogSink
from dflash_core.observe.sinks.wandb_sink import WandbSink  # imports wandb itself only when a run enables it


class RunSinks:
    def __init__(self, bus, cfg: Config, run_dir: Path, early: list = ()):
        """Subscribe the run's sinks to ``bus``. ``early``: the run's events published before
        its folder was known (its first StateChanged), handed to the sinks first so that
        events.jsonl holds the whole run."""
        self.bus = bus
        jsonl = JsonlSink(run_dir / EVENTS_FILE)
        text = TextLogSink(run_dir / "train.log", every_s=cfg.run.log_every_s)
        self._sinks = [jsonl, text]
        self._subs = [bus.subscribe("jsonl", jsonl, critical=True),
                      bus.subscribe("textlog", text, critical=True)]
        for ev in early:
            for sub in self._subs:
                sub.offer(ev)

    def add_wandb(self, cfg: Config, run_dir: Path) -> None:
        """wandb, when enabled: only once preflight has checked its settings against the
        installed wandb, so a stale setting is one clear config error, not wandb's own
        traceback from a sink that started first."""
        if cfg.wandb.enabled and cfg.wandb.mode != "disabled":
            wb = WandbSink(cfg.wandb, run_dir, cfg.run.name, cfg.to_dict(), self.bus.publish)
            self._sinks.append(wb)
            self._subs.append(self.bus.subscribe("wandb", wb, critical=False))

    def close(self) -> None:
        for sub in self._subs:
            self.bus.unsubscribe(sub, timeout=5.0)
        for sink in self._sinks:
            try:
                sink.close()
            except Exception:
                pass
        self._sinks, self._subs = [], []
