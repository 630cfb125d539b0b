import json

from dflash_core.observe.bus import EventBus
from dflash_core.observe.events import Error, GpuSample, RunEnded, StateChanged, StepMetrics
from dflash_core.observe.event_log import read_events
from dflash_core.observe.sinks.jsonl import JsonlSink


def _step(i):
    return StepMetrics(step=i, epoch=0, loss=1.0 / (i + 1), lr=1e-3, grad_norm=0.5,
                       tokens_per_s=1000.0, samples_per_s=2.0, tau_tf=1.5)


def test_every_event_replays(tmp_path):
    path = tmp_path / "run" / "events.jsonl"
    sink = JsonlSink(path)
    events = [StateChanged(state="loading", previous="preflight"), _step(1),
              GpuSample(index=0, name="H200", mem_used=1, mem_total=2),
              Error(error_kind="oom", source="target-0", message="boom", traceback="tb\nline")]
    for ev in events:
        sink(ev)
    # Flushed per line: a reader sees events before close.
    assert read_events(path) == events
    sink.close()
    sink.close()  # idempotent
    assert read_events(path) == events


def test_append_across_restarts_and_torn_line(tmp_path):
    path = tmp_path / "events.jsonl"
    first = JsonlSink(path)
    first(_step(1))
    first.close()
    with open(path, "a", encoding="utf-8") as f:
        f.write('{"event":"StepMetrics","step":2')  # a process killed mid-write
    second = JsonlSink(path)
    second(_step(3))
    second(RunEnded(status="finished", step=3, seconds=1.0))
    second.close()
    got = read_events(path)
    assert [getattr(e, "step", None) for e in got] == [1, 3, 3]
    lines = path.read_text().splitlines()
    assert json.loads(lines[-1])["event"] == "RunEnded"


def test_through_the_bus(tmp_path):
    path = tmp_path / "events.jsonl"
    sink = JsonlSink(path)
    bus = EventBus()
    bus.subscribe("jsonl", sink)
    sent = [_step(i) for i in range(200)]
    for ev in sent:
        bus.publish(ev)
    assert bus.drain(5)
    bus.close()
    sink.close()
    assert read_events(path) == sent
