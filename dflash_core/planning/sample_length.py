"""How long a sample these GPUs can train: the longest data.max_length whose memory plan fits,
with the sizes preflight may lower (memory.fit_sizes, layout.auto_fit's) and drafter.recompute as
configured ("auto" turns it on where one sample needs it). Said at preflight and by
bench/training/plan_vs_peak.py --plan-only."""

from __future__ import annotations

import copy

from dflash_core.config import Config
from dflash_core.planning.memory import fit_sizes

STEP = 1024  # the answer's resolution, in tokens
CEILING = 1 << 20  # the longest asked about: a million tokens


def _fits(cfg: Config, hf_config: dict, length: int, free: dict[str, int] | None,
          total: dict[str, int] | None, quantized: bool | None) -> bool:
    trial = copy.deepcopy(cfg)
    trial.data.max_length = length
    trial.data.token_budget = max(cfg.data.token_budget, length)  # a batch holds one at least
    return fit_sizes(trial, hf_config, free, total, quantized) is not None


def longest_sample(cfg: Config, hf_config: dict, free: dict[str, int] | None,
                   total: dict[str, int] | None = None, quantized: bool | None = None) -> int:
    """The longest sample, in tokens (a multiple of STEP, at most CEILING), whose plan fits
    ``free``; 0 when not even STEP tokens do. Each longer sample needs more of every GPU, so
    a bisection finds it."""
    lo, hi = 0, CEILING // STEP  # in STEPs: lo fits (0 trivially), hi is the ceiling
    if _fits(cfg, hf_config, hi * STEP, free, total, quantized):
        return CEILING
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if _fits(cfg, hf_config, mid * STEP, free, total, quantized):
            lo = mid
        else:
            hi = mid
    return lo * STEP
