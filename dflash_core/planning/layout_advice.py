"""Which side bounds the run, and the split of the node's GPUs that would balance it, from rates
measured in this run: each target's and each drafter's throughput while it works (time blocked on
a full queue or waiting on an empty one taken out). Said once, in the log, after a few steps."""

from __future__ import annotations

import statistics
from typing import Any, Callable

from dflash_core.observe.events import Log, StepMetrics, TargetMetrics

ADVISE_AT_STEP = 20  # steps of real training before the rates are trusted (compile, warm-up)
MIN_BUSY = 0.05  # a side busier than this share of its time gives a usable rate
# A target's rate is the median of its last reports: in a run's first steps a batch of a size the
# machine has not met compiles kernels (seconds for a hybrid target), which one report can catch.
TARGET_REPORTS = 9


class LayoutAdvisor:
    """A bus tap for one run: collects the rates and publishes one Log with the advice."""

    def __init__(self, publish: Callable[[Any], None], targets: int, drafters: int, gpus: int,
                 at_step: int | None = None):
        self.publish, self.targets, self.drafters, self.gpus = publish, targets, drafters, gpus
        self.at_step = at_step or ADVISE_AT_STEP
        self._target_tokens: dict[str, list[float]] = {}  # worker -> tokens/s while working
        self._drafter_samples: list[float] = []  # per drafter, samples/s while working
        self._tokens = self._samples = 0
        self.done = False

    def __call__(self, ev) -> None:
        if self.done:
            return
        if isinstance(ev, TargetMetrics):
            busy = 1.0 - ev.blocked_frac - ev.starved_frac
            if busy >= MIN_BUSY and ev.tokens_per_s > 0:
                rates = self._target_tokens.setdefault(ev.worker, [])
                rates.append(ev.tokens_per_s / busy)
                del rates[:-TARGET_REPORTS]
        elif isinstance(ev, StepMetrics) and ev.step > 3:  # the first steps include compiling
            self._tokens += ev.tokens_per_s
            self._samples += ev.samples_per_s
            busy = 1.0 - ev.drafter_wait_frac
            if busy >= MIN_BUSY and ev.samples_per_s > 0:
                self._drafter_samples.append(ev.samples_per_s / self.drafters / busy)
            if ev.step >= self.at_step and self._target_tokens and self._drafter_samples:
                self.done = True
                self.publish(Log(level="info", source="layout", message=self.advice()))

    def rates(self) -> tuple[float, float]:
        """(samples/s one target can extract, samples/s one drafter can train)."""
        tokens_per_sample = self._tokens / self._samples if self._samples else 1.0
        per_target = [statistics.median(r) for r in self._target_tokens.values()]
        target = sum(per_target) / len(per_target) / tokens_per_sample
        recent = self._drafter_samples[-10:]
        return target, sum(recent) / len(recent)

    def advice(self) -> str:
        target, drafter = self.rates()
        feeds = target / drafter
        have = min(self.targets * target, self.drafters * drafter)
        bound = ("targets" if self.targets * target < self.drafters * drafter else "drafters")
        best_t = max(range(1, self.gpus), key=lambda t: min(t * target, (self.gpus - t) * drafter),
                     default=1)
        best = min(best_t * target, (self.gpus - best_t) * drafter)
        text = (f"measured: one target extracts {target:.2f} samples/s, one drafter trains "
                f"{drafter:.2f}: 1 target feeds {feeds:.1f} drafters; the {bound} bound this "
                f"run ({self.targets} + {self.drafters}: ~{have:.2f} samples/s)")
        if self.gpus > 1:
            text += (f"; for {self.gpus} GPUs: {best_t} target(s) + {self.gpus - best_t} "
                     f"drafter(s), ~{best:.2f} samples/s")
        return text
