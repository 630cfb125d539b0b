from dflash_core.observe.events import (
    Checkpoint, Error, EvalResult, GpuSample, HostSample, LoadProgress, Log, MemoryPlan,
    QueueDepth, RunEnded, RunStarted, SinkStatus, StateChanged, StepMetrics,
)
from dflash_core.observe.sinks.textlog import LineThrottle, TextLogSink, format_event


def _step(i, ts):
    return StepMetrics(step=i, epoch=0, loss=2.5, lr=6e-4, grad_norm=1.0, tokens_per_s=31000.0,
                       samples_per_s=3.8, tau_tf=2.0, ts=ts)


def _load(loaded, ts, done=False):
    return LoadProgress(worker="target-0", device="cuda:0", bytes_loaded=loaded, bytes_total=100,
                        shards_loaded=0, shards_total=4, seconds=1.0, done=done, ts=ts)


def test_format_every_kind():
    GiB = 1024**3
    changed = StateChanged(state="loading", previous="preflight")
    assert "preflight -> loading" in format_event(changed)
    assert "step 7" in format_event(_step(7, 0.0)) and "loss 2.5000" in format_event(_step(7, 0.0))
    old_eval = format_event(EvalResult(step=5, tau=3.21, acceptance=[1, 2], prompts=8))
    assert "tau exact 3.21 | tf target - |" in old_eval and "accepted@k 67%" in old_eval
    assert "eval step 5 on 8 prompts: " in old_eval  # recorded before its duration was
    timed = format_event(EvalResult(step=5, tau=3.21, acceptance=[1, 2], prompts=8, seconds=83.4))
    assert "eval step 5 on 8 prompts in 1m23s: tau exact 3.21" in timed
    full = format_event(EvalResult(step=5, tau=3.21, acceptance=[1, 2], prompts=8,
                                   tau_tf_target=3.4, tau_tf_heldout=3.3, tau_tf_train=4.0,
                                   agreement=0.97, agreement_positions=100))
    assert ("tau exact 3.21 | tf target 3.40 | tf held-out 3.30 | tf train 4.00 | "
            "labels = target 97% | accepted@k 67%") in full
    assert "/ck/step-5" in format_event(Checkpoint(step=5, path="/ck/step-5", seconds=2.0))
    assert format_event(Log(level="warning", source="engine", message="hi")) == \
        "[warning] engine: hi"
    started = format_event(RunStarted(run_name="r", run_dir="/runs/r", config={},
                                      targets=["cuda:0"], drafters=["cuda:1"]))
    assert "run r started" in started
    assert "finished at step 9" in format_event(RunEnded(status="finished", step=9, seconds=75))
    assert "wandb: ok (/x)" in format_event(SinkStatus(sink="wandb", status="ok", detail="/x"))
    plan = format_event(MemoryPlan(rows=[{"device": "cuda:0", "role": "target",
                                          "components": {"weights": 54 * GiB}, "total": 60 * GiB,
                                          "free": 140 * GiB, "fits": True}]))
    assert "cuda:0" in plan and "weights 54.0 GiB" in plan and "60.0 GiB" in plan
    err = format_event(Error(error_kind="oom", source="target-3", message="CUDA out of memory",
                             traceback="Traceback (most recent call last):\n  File x\nOOM\n",
                             hint="lower data.token_budget", device="cuda:3"))
    lines = err.splitlines()
    assert lines[0].startswith("ERROR [oom] target-3 (cuda:3) fatal: CUDA out of memory")
    assert "hint: lower data.token_budget" in lines[1]
    assert all(line.startswith("    ") for line in lines[2:]) and len(lines) == 5
    for chatty in (GpuSample(index=0, name="g", mem_used=1, mem_total=2),
                   HostSample(ram_used=1, ram_total=2, cpu_percent=1.0),
                   QueueDepth(name="hs", depth=1, capacity=8)):
        assert format_event(chatty) is None


def test_throttle_steps_and_load():
    th = LineThrottle(every_s=5.0)
    admitted = [i for i in range(20) if th.admit(_step(i, ts=100.0 + i))]
    assert admitted == [0, 5, 10, 15]  # first always, then one per 5 s of event time
    th = LineThrottle()
    kept = [b for b in range(0, 100, 3) if th.admit(_load(b, ts=b))]
    assert kept == [0, 12, 21, 30, 42, 51, 60, 72, 81, 90]  # one per new 10%
    assert th.admit(_load(100, ts=200, done=True))


def test_sink_writes_stamped_lines(tmp_path):
    path = tmp_path / "train.log"
    sink = TextLogSink(path, every_s=5.0)
    sink(StateChanged(state="training", previous="warmup", ts=1000.0))
    for i in range(10):
        sink(_step(i, ts=1000.0 + i))
    sink(GpuSample(index=0, name="g", mem_used=1, mem_total=2))
    sink(Error(error_kind="data", source="loader-0", message="bad shard", traceback="T1\nT2\n",
               fatal=False))
    sink.close()
    sink.close()
    lines = path.read_text().splitlines()
    assert len([line for line in lines if " step " in line]) == 2
    assert lines[0][:4].isdigit() and "warmup -> training" in lines[0]
    assert lines[-1].strip() == "T2" and lines[-1].startswith(" " * 20)
    assert not any("H200" in line or "mem" in line for line in lines)
