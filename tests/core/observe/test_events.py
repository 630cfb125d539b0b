"""Events round-trip through JSON; the bus never lets a subscriber block or break the publisher."""

import dataclasses
import subprocess
import sys
import threading
import time

from dflash_core.observe import events as ev
from dflash_core.observe.event_log import read_events
from dflash_core.observe.bus import EventBus


def sample_events():
    return [
        ev.RunStarted(run_name="r", run_dir="runs/r", config={"a": 1}, targets=["cuda:0"],
                      drafters=["cuda:7"]),
        ev.StateChanged(state="loading", previous="preflight"),
        ev.LoadProgress(worker="target-0", device="cuda:0", bytes_loaded=5, bytes_total=10,
                        shards_loaded=1, shards_total=2, seconds=1.5),
        ev.StepMetrics(step=3, epoch=0, loss=2.5, lr=1e-4, grad_norm=0.3, tokens_per_s=1e4,
                       samples_per_s=3.0, tau_tf=2.2),
        ev.Error(error_kind="oom", source="target-3", message="boom", traceback="tb",
                 hint="lower x"),
        ev.MemoryPlan(rows=[{"device": "cuda:0", "total": 1, "free": None}], fits=False),
        ev.RunEnded(status="failed", step=3, seconds=10.0),
        ev.NodeStatus(node=1, host="n1", step=3, samples_per_s=2.5, hs_depth=1, hs_capacity=8,
                      prefetch=[[2, 4]], gpu_mem=[5], ending="failed", error="drafter-0: boom"),
    ]


def test_every_event_type_round_trips(tmp_path):
    path = tmp_path / "events.jsonl"
    originals = sample_events()
    path.write_text("\n".join(e.to_json() for e in originals) + "\n{\"event\": \"Sta")  # torn tail
    back = read_events(path)
    assert back == originals
    assert {type(e) for e in originals} <= set(ev.EVENT_TYPES.values())


def test_slow_subscriber_never_blocks_publish():
    bus = EventBus()
    release = threading.Event()
    got = []
    bus.subscribe("slow", lambda e: (release.wait(5), got.append(e)), maxsize=10)
    t = time.monotonic()
    for i in range(1000):
        bus.publish(ev.Log(level="info", source="t", message=str(i)))
    assert time.monotonic() - t < 1.0  # 1000 publishes while the subscriber sleeps
    release.set()
    assert bus.drain(5)
    assert 0 < len(got) <= 11  # bounded queue: the rest were dropped, not queued forever
    bus.close()


def test_broken_subscriber_reports_once_and_others_continue():
    bus = EventBus()
    seen, errors = [], []
    bus.tap(lambda e: errors.append(e) if isinstance(e, ev.Error) else None)

    def broken(e):
        raise OSError("disk gone")

    bus.subscribe("jsonl", broken, critical=True)
    bus.subscribe("ok", seen.append)
    for i in range(5):
        bus.publish(ev.Log(level="info", source="t", message=str(i)))
    assert bus.drain(5)
    time.sleep(0.1)
    assert len(errors) == 1
    assert errors[0].source == "sink:jsonl" and errors[0].error_kind == "io" and errors[0].fatal
    assert len([e for e in seen if isinstance(e, ev.Log)]) == 5
    bus.close()
    assert not any(t.name.startswith("sink-") for t in threading.enumerate())


def test_bus_and_error_helpers_do_not_import_torch():
    # The dashboard (replay, attach) and the sinks use them; torch stays out of those processes.
    code = ("import sys, dflash_core.observe.bus, dflash_core.observe.errors, dflash_core.observe.events; "
            "sys.exit('torch' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_an_error_line_written_before_the_kind_field_was_renamed_still_loads(tmp_path):
    # events.jsonl files from before the rename name the error kind "kind_".
    old = ('{"ts":1700000000.0,"kind_":"oom","source":"target-3","message":"boom",'
           '"traceback":"","hint":"lower x","fatal":true,"device":"cuda:3","phase":"training",'
           '"event":"Error"}')
    e = ev.from_json(old)
    assert e == ev.Error(error_kind="oom", source="target-3", message="boom", hint="lower x",
                         device="cuda:3", phase="training", ts=1700000000.0)
    path = tmp_path / "events.jsonl"
    path.write_text(old + "\n" + e.to_json() + "\n")
    assert read_events(path) == [e, e]
    assert '"error_kind":"oom"' in e.to_json() and "kind_" not in e.to_json()


def test_queue_names_and_worker_statuses_keep_their_wire_form():
    # Written into events.jsonl and read back by the dashboard: old files must still read.
    assert (ev.prefetch_queue(0), ev.prefetch_queue(12), ev.HS_QUEUE) == ("prefetch-0",
                                                                         "prefetch-12", "hs")
    assert [ev.prefetch_rank(ev.prefetch_queue(r)) for r in (0, 3, 12)] == [0, 3, 12]
    assert [ev.prefetch_rank(n) for n in ("hs", "prefetch", "prefetch-x", "loader-1")] == [None] * 4
    assert ev.WORKER_STATUSES == ("loading", "warmup", "running", "done", "stopped", "failed")


def test_training_plan_says_which_limit_ends_the_run():
    plan = ev.TrainingPlan(start_step=0, total_steps=512, epochs=8, epoch_steps=512,
                           max_steps=100000, max_steps_from="--max-steps", targets=1, drafters=1)
    assert plan.by_epochs and plan.limit(short=True) == "8 epochs"
    assert plan.limit() == ("512 steps = 8 epochs of the data (optim.epochs); --max-steps 100000 "
                            "is past it")
    assert plan.summary().startswith("training 512 steps on 1 target(s) + 1 drafter(s): 512 ")
    named = dataclasses.replace(plan, recipe="loss dflash (gamma 7); optimizer adamw (lr 0.0006)")
    assert named.summary() == plan.summary() + "; loss dflash (gamma 7); optimizer adamw (lr 0.0006)"
    capped = ev.TrainingPlan(start_step=200, total_steps=300, epochs=8, epoch_steps=512,
                             max_steps=300)
    assert not capped.by_epochs and capped.limit(short=True) == "run.max_steps 300"
    assert capped.limit() == "300 steps: run.max_steps 300 (8 epochs of the data would be 512)"
    assert capped.summary().startswith("training from step 200 to 300 on ")
    alone = ev.TrainingPlan(start_step=0, total_steps=64, epochs=1, epoch_steps=64)
    assert alone.limit() == "64 steps = 1 epoch of the data (optim.epochs)"
    assert ev.from_json(plan.to_json()) == plan
