"""The embedded demo on a GPU node runs on the GPUs: compiled FlexAttention, per-GPU telemetry."""

import torch

from dflash_core import demo
from dflash_core.observe.events import EvalResult, GpuSample, Log, RunStarted, StepMetrics
from tests.gpu.watch import Watched


def test_demo_trains_on_the_gpus(tmp_path, demo_data):
    cfg = demo.demo_config(output_dir=str(tmp_path / "runs"), device="auto")  # the CLI default
    assert cfg.layout.device == "cuda"
    cfg.run.max_steps = 60
    run = Watched()
    run.run(cfg, timeout=600)
    (started,) = run.of(RunStarted)
    assert all(d.startswith("cuda:") for d in started.targets + started.drafters)
    assert len(run.of(StepMetrics)) == 60
    assert run.of(GpuSample), "no per-GPU telemetry"
    assert run.of(EvalResult)
    # its features stay below the target's last layer: the preflight has nothing to say of it
    assert not [e for e in run.of(Log) if "the target's last" in e.message]
    assert torch.cuda.device_count() >= 1
