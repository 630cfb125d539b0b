"""The embedded demo on a GPU node runs on the GPUs: compiled FlexAttention, per-GPU telemetry."""

import torch

from dflash_core import demo
from dflash_core.observe.bus import EventBus
from dflash_core.pipeline.engine import Engine
from dflash_core.observe.events import Error, EvalResult, GpuSample, RunStarted, StepMetrics


def test_demo_trains_on_the_gpus(tmp_path, demo_data):
    cfg = demo.demo_config(output_dir=str(tmp_path / "runs"), device="auto")  # the CLI default
    assert cfg.layout.device == "cuda"
    cfg.run.max_steps = 60
    bus = EventBus()
    seen, errors = [], []
    bus.tap(seen.append)
    bus.tap(lambda e: errors.append(f"{e.source}: {e.message}\n{e.traceback}")
            if isinstance(e, Error) else None)
    engine = Engine(cfg, bus=bus)
    engine.start()
    assert engine.wait(600) == "finished", "\n".join(errors)
    (started,) = [e for e in seen if isinstance(e, RunStarted)]
    assert all(d.startswith("cuda:") for d in started.targets + started.drafters)
    assert len([e for e in seen if isinstance(e, StepMetrics)]) == 60
    assert [e for e in seen if isinstance(e, GpuSample)], "no per-GPU telemetry"
    assert [e for e in seen if isinstance(e, EvalResult)]
    assert torch.cuda.device_count() >= 1
