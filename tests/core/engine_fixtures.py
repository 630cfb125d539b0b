"""Tiny targets, data and configs for engine tests (random weights: speed, not learning)."""

import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from transformers import Qwen3Config, Qwen3ForCausalLM

from dflash_core.config import config_from_dict
from dflash_core.data import write_shards
from dflash_core.pipeline.engine import Engine
from dflash_core.observe.events import RunEnded, StateChanged

VOCAB = 128


def make_target(folder: Path, seed: int = 0, head_dim: int = 8) -> Path:
    """head_dim 16 or more on GPU runs the drafter's compiled FlexAttention (8 runs chunked)."""
    cfg = Qwen3Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=6,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim,
                      max_position_embeddings=512)
    torch.manual_seed(seed)
    Qwen3ForCausalLM(cfg).save_pretrained(folder)
    return folder


def make_data(folder: Path, n: int = 64, seed: int = 0) -> Path:
    rng = np.random.default_rng(seed)
    samples = []
    for _ in range(n):
        L = int(rng.integers(24, 64))
        p = int(rng.integers(4, 12))
        ids = rng.integers(0, VOCAB - 1, L).tolist()
        samples.append({"input_ids": ids, "loss_mask": [0] * p + [1] * (L - p)})
    write_shards(samples, folder, samples_per_shard=32)
    return folder


def make_config(tmp: Path, target: Path, data: Path, **over):
    d = {
        "run": {"name": "t", "output_dir": str(tmp / "runs"), "max_steps": 6, "seed": 1},
        "target": {"path": str(target), "dtype": "float32", "num_features": 2},
        # DFlash: the engine tests' paths; DSpark's tests say drafter__objective="dspark"
        "drafter": {"objective": "dflash", "num_layers": 1, "block_size": 4, "num_anchors": 8,
                    "loss_chunk": 64},
        "data": {"path": str(data), "token_budget": 256, "max_seqs_per_batch": 4,
                 "max_length": 64, "prefetch_batches": 2, "eval_prompts": 2},
        "layout": {"device": "cpu", "targets": [0], "drafters": [0], "hs_queue": 2},
        "optim": {"lr": 1e-3, "epochs": 1},
        "checkpoint": {"every": 3, "keep": 2},
        "eval": {"max_new_tokens": 8},
        "telemetry": {"interval_s": 0.2},
    }
    for key, value in over.items():
        section, name = key.split("__")
        d.setdefault(section, {})[name] = value
    return config_from_dict(d)


# --------------------------------------------------------------------------------------------
# Helpers for engine tests: shared assets, an event recorder, thread checks
# --------------------------------------------------------------------------------------------

# Threads the engine (and its bus subscriptions) start; anything else (tqdm's monitor, pytest's)
# is not ours to judge.
ENGINE_THREADS = ("engine", "target-", "drafter-", "loader-", "telemetry", "watchdog",
                  "sink-jsonl", "sink-textlog", "sink-wandb")
FAIL_WITHIN_S = 5.0
FOREIGN_THREADS = ("tqdm",)  # started by libraries on first use, not by the engine


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    """(target folder, data folder): a tiny random Qwen3 and 64 samples, made once per module."""
    root = tmp_path_factory.mktemp("assets")
    return make_target(root / "target"), make_data(root / "data")


def engine_threads() -> list[str]:
    return sorted(t.name for t in threading.enumerate()
                  if t.is_alive() and t.name.startswith(ENGINE_THREADS))


def wait_no_engine_threads(timeout: float = 5.0) -> list[str]:
    """Engine threads still alive after ``timeout`` seconds (empty when all are gone)."""
    deadline = time.monotonic() + timeout
    while engine_threads() and time.monotonic() < deadline:
        time.sleep(0.02)
    return engine_threads()


class Recorder:
    """Every event the bus carries, in publish order (a tap: synchronous, in the publisher's
    thread), with waits for the one a test needs next."""

    def __init__(self, bus):
        self.events: list = []
        self._cond = threading.Condition()
        bus.tap(self._on_event)

    def _on_event(self, ev) -> None:
        with self._cond:
            self.events.append(ev)
            self._cond.notify_all()

    def of(self, cls) -> list:
        with self._cond:
            return [e for e in self.events if isinstance(e, cls)]

    def states(self) -> list[str]:
        return [e.state for e in self.of(StateChanged)]

    def wait_for(self, pred, timeout: float = 30.0):
        """The first event with ``pred(ev)`` true, waiting up to ``timeout`` seconds for it."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                for ev in self.events:
                    if pred(ev):
                        return ev
                left = deadline - time.monotonic()
                if left <= 0:
                    kinds = [e.kind for e in self.events][-20:]
                    raise AssertionError(f"no matching event within {timeout} s; last: {kinds}")
                self._cond.wait(left)

    def wait_ended(self, timeout: float = 60.0) -> RunEnded:
        return self.wait_for(lambda e: isinstance(e, RunEnded), timeout)


def write_config(path: Path, cfg) -> Path:
    """A Config as a YAML file (what --config and restart read)."""
    path.write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False), encoding="utf-8")
    return path


def restart_and_train(engine, rec: Recorder, timeout: float = 60.0) -> None:
    """engine.restart(), then wait until the new run has ended the old one and trained a step
    of its own (so the next restart again interrupts training)."""
    from dflash_core.observe.events import RunStarted, StepMetrics

    n, started = len(rec.of(RunEnded)), len(rec.of(RunStarted))
    engine.restart()
    rec.wait_for(lambda e: isinstance(e, RunEnded) and len(rec.of(RunEnded)) > n, timeout)
    # A step of the NEW run: the old run's last step may land after restart() was called, and a
    # restart pressed before the new run exists would find nothing to abort.
    rec.wait_for(lambda e: isinstance(e, StepMetrics) and len(rec.of(RunStarted)) > started
                 and e.ts >= rec.of(RunStarted)[-1].ts, timeout)


# --------------------------------------------------------------------------------------------
# Running an engine in a test: started and ended, with nothing left behind
# --------------------------------------------------------------------------------------------

def long_config(tmp_path, assets, **over):
    """A run far longer than any test waits: it ends by fault or abort, not by finishing."""
    target, data = assets
    over = {"run__max_steps": 0, "optim__epochs": 200, "data__eval_prompts": 0,
            "checkpoint__every": 0, **over}
    return make_config(tmp_path, target, data, **over)


def new_threads(before: set) -> list[str]:
    """Threads alive now that were not before, other than library ones."""
    return sorted(t.name for t in threading.enumerate()
                  if t not in before and t.is_alive() and not t.name.startswith(FOREIGN_THREADS))


def wait_gone(before: set, timeout: float = FAIL_WITHIN_S) -> list[str]:
    deadline = time.monotonic() + timeout
    while new_threads(before) and time.monotonic() < deadline:
        time.sleep(0.02)
    return new_threads(before)


_live: list[Engine] = []


@pytest.fixture(autouse=True)
def shutdown_started_engines():
    """A test that fails midway must not leave its (long) run going under the next tests.
    Autouse in every module that imports it."""
    yield
    while _live:
        _live.pop().shutdown(timeout=10)


def started(cfg, **kw) -> tuple[Engine, Recorder, set]:
    assert engine_threads() == [], "an earlier test left engine threads running"
    before = set(threading.enumerate())
    engine = Engine(cfg, **kw)
    _live.append(engine)
    rec = Recorder(engine.bus)
    engine.start()
    return engine, rec, before


def ended(engine: Engine, rec: Recorder, timeout: float = 30.0) -> RunEnded:
    end = rec.wait_ended(timeout)
    assert engine.join(10), "supervisor still alive after RunEnded"
    engine.shutdown()
    return end


def run_config(cfg, timeout: float = 120.0) -> tuple[RunEnded, Recorder]:
    """A run of ``cfg`` from start to RunEnded in a fresh engine, shut down after: its end and
    every event it published."""
    engine = Engine(cfg)
    rec = run_to_end(engine, timeout)
    engine.shutdown()
    return rec.of(RunEnded)[-1], rec


def run_to_end(engine: Engine, timeout: float = 60.0) -> Recorder:
    rec = Recorder(engine.bus)
    engine.start()
    rec.wait_ended(timeout)
    assert engine.join(10), "the supervisor thread outlived RunEnded"
    return rec
