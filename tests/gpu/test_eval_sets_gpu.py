"""The run's evaluation on named prompt sets (eval.prompt_sets) on a GPU: rendered with the
target's chat template, decoded with the evaluation's uncompiled attention while training uses
compiled FlexAttention, one EvalResult per set, and the run's device time counted in GPU-hours."""

import torch

from dflash_core import demo
from dflash_core.config import config_from_dict
from dflash_core.observe.events import DeviceHours, EvalResult

from tests.core.pipeline.test_eval_sets_run import write_sets
from tests.gpu.watch import Watched


def test_a_gpu_run_evaluates_its_prompt_sets_and_counts_gpu_hours(tmp_path, demo_data):
    files = write_sets(tmp_path / "sets")
    d = demo.demo_config(output_dir=str(tmp_path / "runs"), device="auto").to_dict()
    d["run"].update(max_steps=20)
    d["eval"].update(every=10, max_new_tokens=16, prompt_sets=[
        {"name": "chat", "path": str(files["chat"])},
        {"name": "plain", "path": str(files["plain"]), "prompts": 2}])
    d["cost"].update(gpu_hour_price=2.5)
    cfg = config_from_dict(d)
    assert cfg.layout.device == "cuda"
    run = Watched()
    run.run(cfg, timeout=600)
    evals = [(e.step, e.prompt_set) for e in run.of(EvalResult)]
    assert evals == [(10, ""), (10, "chat"), (10, "plain"), (20, ""), (20, "chat"),
                     (20, "plain")]
    for e in run.of(EvalResult):
        if e.prompt_set:
            assert e.prompts == {"chat": 4, "plain": 2}[e.prompt_set] and e.tau >= 1.0
    hours = run.of(DeviceHours)
    end = hours[-1]
    assert end.reason == "end" and end.gpu_target > 0 and end.gpu_drafter > 0
    assert end.host_target == end.host_drafter == 0 and end.price == 2.5
    assert torch.cuda.device_count() >= 1
