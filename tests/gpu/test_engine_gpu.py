"""Restarting the engine on a GPU again and again leaves no device memory, thread or host memory
behind (the CPU variant is in tests/core/pipeline/test_engine_faults.py)."""

import threading
from pathlib import Path

import psutil
import torch

from dflash_core.pipeline.engine import Engine
from dflash_core.observe.events import RunEnded, StepMetrics
from tests.core.engine_fixtures import (
    Recorder, engine_threads, make_config, make_data, make_target, restart_and_train,
    wait_no_engine_threads,
)

RESTARTS = 20
MIB = 2**20


def test_restarts_during_training_free_gpu_memory(tmp_path: Path):
    target = make_target(tmp_path / "target", head_dim=16)
    data = make_data(tmp_path / "data")
    cfg = make_config(tmp_path, target, data, layout__device="cuda", target__dtype="bfloat16",
                      run__max_steps=0, optim__epochs=500, data__eval_prompts=0,
                      checkpoint__every=0, checkpoint__keep=1)
    assert engine_threads() == []
    base = torch.cuda.memory_allocated()
    engine = Engine(cfg)
    rec = Recorder(engine.bus)
    # Device memory as each run ends: the tap runs in the supervisor right after it freed the run.
    at_end: list[int] = []
    engine.bus.tap(lambda e: at_end.append(torch.cuda.memory_allocated())
                   if isinstance(e, RunEnded) else None)
    proc = psutil.Process()
    try:
        engine.start()
        rec.wait_for(lambda e: isinstance(e, StepMetrics), 300)
        training = torch.cuda.memory_allocated()
        assert training - base > MIB, "nothing on the GPU while training: not a GPU run"
        restart_and_train(engine, rec, 300)  # warm-up: CUDA context, kernels, caches
        threads0, rss0 = len(threading.enumerate()), proc.memory_info().rss
        for _ in range(RESTARTS):
            restart_and_train(engine, rec, 300)
        assert len(threading.enumerate()) <= threads0
        assert proc.memory_info().rss - rss0 < 200 * MIB
    finally:
        engine.shutdown()
    assert engine.state == "aborted"
    assert len(at_end) == RESTARTS + 2
    assert max(at_end) - base < 16 * MIB, [f"{(m - base) / MIB:.1f} MiB" for m in at_end]
    assert at_end[-1] - at_end[1] < MIB
    assert wait_no_engine_threads() == []
