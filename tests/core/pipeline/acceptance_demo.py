"""The demo trained with a fault planted (or none), for the acceptance tests and
bench/eval/acceptance_gaps.py: each run's evaluations and the findings its log raised.

Faults:
- ``leak``: training's block attention lets each block see the context up to its anchor + ``leak``
  (its own labels' features); decoding cannot show them (they do not exist yet there).
- ``foreign``: data whose prompts are the demo's and whose responses are the text that follows
  them in the held-out corpus, not the target's greedy continuation.
- ``overfit``: a handful of the demo's samples trained for many epochs.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from dflash_core import demo
from dflash_core.config import config_from_dict
from dflash_core.data import ShardedDataset, write_shards
from dflash_core.models import block_attention
from dflash_core.observe.events import EvalResult, Log, RunEnded, StepMetrics
from dflash_core.pipeline.engine import Engine

FAULTS = ("none", "leak", "foreign", "overfit")


@dataclass
class DemoRun:
    ended: RunEnded
    evals: list[EvalResult]
    findings: list[Log]  # the eval warnings and information lines
    steps: int
    seconds: float  # wall time from the first step to the end
    eval_seconds: float  # the evaluations' share of it, summed

    def kinds(self) -> set[str]:
        return {k for e in self.evals for k in e.findings}


@contextlib.contextmanager
def leaking(extra: int):
    """Training's chunked block attention sees ``extra`` context positions at and past each
    block's anchor (a mask error). Decoding's context ends before the anchor, so it sees none."""
    if not extra:
        yield
        return
    original = block_attention.chunked_block_attention

    def leaky(q, k_ctx, v_ctx, k_blk, v_blk, anchors, block_size, scale, *args, **kw):
        shifted = anchors.where(anchors < 0, anchors + extra)
        return original(q, k_ctx, v_ctx, k_blk, v_blk, shifted, block_size, scale, *args, **kw)

    block_attention.chunked_block_attention = leaky
    try:
        yield
    finally:
        block_attention.chunked_block_attention = original


def foreign_data(folder: Path, n: int = demo.DATA_SAMPLES, seed: int = 0) -> Path:
    """The demo's prompts with the held-out corpus text after each as its response."""
    _, heldout = demo.split_corpus()
    P, R = demo.DATA_PROMPT_LEN, demo.DATA_RESPONSE_LEN
    rng = np.random.default_rng([seed, 2])  # demo_prompts' own draw: the same prompts
    starts = np.minimum(rng.integers(0, len(heldout) - P, n), len(heldout) - P - R)
    samples = [{"input_ids": heldout[s: s + P + R].tolist(), "loss_mask": [0] * P + [1] * R}
               for s in starts]
    write_shards(samples, folder, samples_per_shard=256, fmt="arrow")
    return folder


def few_samples(folder: Path, demo_data: Path, n: int) -> Path:
    """The first ``n`` samples of the demo data."""
    ds = ShardedDataset.open(demo_data)
    samples = [{"input_ids": ids.tolist(), "loss_mask": mask.tolist()}
               for ids, mask in (ds.get(i) for i in range(n))]
    write_shards(samples, folder, samples_per_shard=256, fmt="arrow")
    return folder


def demo_cfg(tmp: Path, *, seed: int, steps: int, every: int, data: str = "builtin:demo",
             device: str = "cpu", **over):
    d = demo.demo_config(output_dir=str(tmp / "runs"), name=f"s{seed}", device=device).to_dict()
    d["run"].update(seed=seed, max_steps=steps, log_every_s=60.0)
    d["eval"].update(every=every)
    d["data"].update(path=data)
    d["checkpoint"].update(every=0, keep=1)
    for key, value in over.items():
        section, name = key.split("__")
        d[section][name] = value
    return config_from_dict(d)


def run_demo(tmp: Path, demo_data: Path, *, fault: str = "none", seed: int = 0,
             steps: int = 100, every: int = 100, timeout: float = 900.0,
             overfit_samples: int = 16, device: str = "cpu", **over) -> DemoRun:
    """Train the demo for ``steps`` with ``fault`` planted; evaluate every ``every`` steps
    (``overfit_samples``: the data set of the over-fitting fault, held-out ones included)."""
    tmp = Path(tmp) / f"{fault}-s{seed}"
    tmp.mkdir(parents=True, exist_ok=True)
    data = "builtin:demo"
    if fault == "foreign":
        data = str(foreign_data(tmp / "data", seed=seed))
    elif fault == "overfit":
        # data.eval_prompts of them are held out, the rest trained on every step
        data = str(few_samples(tmp / "data", demo_data, overfit_samples))
        over = {"optim__epochs": 10_000, **over}
    cfg = demo_cfg(tmp, seed=seed, steps=steps, every=every, data=data, device=device, **over)
    engine = Engine(cfg)
    events: list = []
    engine.bus.tap(events.append)
    # One intra-op thread, as the demo's build: on a busy machine a second one spins at every
    # barrier, and the end-of-run evaluation (in the engine thread) ran 20x slower with two.
    with leaking(4 if fault == "leak" else 0), demo.torch_threads(1):
        engine.start()
        deadline = time.monotonic() + timeout
        while not any(isinstance(e, RunEnded) for e in events):
            if time.monotonic() > deadline:
                engine.shutdown(timeout=10)
                raise AssertionError(f"the demo run ({fault}, seed {seed}) did not end in "
                                     f"{timeout:.0f} s")
            time.sleep(0.05)
        engine.join(10)
    engine.shutdown()
    steps_ev = [e for e in events if isinstance(e, StepMetrics)]
    evals = [e for e in events if isinstance(e, EvalResult)]
    first = steps_ev[0].ts if steps_ev else time.time()
    end = [e for e in events if isinstance(e, RunEnded)][-1]
    return DemoRun(end, evals, [e for e in events if isinstance(e, Log) and e.source == "eval"],
                   steps_ev[-1].step if steps_ev else 0, end.ts - first,
                   sum(e.seconds for e in evals))
