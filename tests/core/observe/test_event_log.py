"""events.jsonl through ``event_log``: every kind written and read back, the kind peek, the last
run of a file holding two, and a torn last line."""

import dataclasses
import json

import pytest

from dflash_core.observe import event_log
from dflash_core.observe import events as ev

# A value for each annotated field type of the event dataclasses (annotations are strings).
_VALUES = {"str": "x \"quoted\" \u00e9", "int": 7, "float": 2.5, "bool": False,
           "list": [1, [2, 3]], "dict": {"a": {"b": [1, 2]}}}


def one_of_every_kind() -> list[ev.Event]:
    """An instance of every event type, each field set to a value that is not its default."""
    out = []
    for i, cls in enumerate(ev.EVENT_TYPES.values()):
        kwargs = {}
        for f in dataclasses.fields(cls):
            if f.name == "ts":
                continue
            kwargs[f.name] = _VALUES[str(f.type).split(" ")[0]]
        out.append(cls(ts=1_700_000_000.0 + i, **kwargs))
    return out


def _started(name: str, ts: float) -> ev.RunStarted:
    return ev.RunStarted(run_name=name, run_dir=f"runs/{name}", config={}, targets=["cpu:0"],
                         drafters=["cpu:0"], ts=ts)


def _step(i: int, ts: float) -> ev.StepMetrics:
    return ev.StepMetrics(step=i, epoch=0, loss=1.0, lr=1e-4, grad_norm=1.0, tokens_per_s=1.0,
                          samples_per_s=1.0, tau_tf=2.0, ts=ts)


def test_every_kind_round_trips_through_writer_and_reader(tmp_path):
    events = one_of_every_kind()
    assert {e.kind for e in events} == set(ev.EVENT_TYPES)
    path = tmp_path / "run" / "events.jsonl"
    writer = event_log.EventLogWriter(path)
    for e in events:
        writer(e)
    writer.close()
    assert event_log.read_events(path) == events
    assert event_log.read_events(path.parent) == events  # the run folder names its file
    lines = path.read_text(encoding="utf-8").splitlines()
    assert len(lines) == len(events)
    for line, e in zip(lines, events):
        assert event_log.parse(line) == e
        assert event_log.kind_of(line) == e.kind
        assert event_log.kind_marker(e.kind) in line.encode()
        assert list(json.loads(line))[-1] == "event"  # what the peek relies on


def test_peek_is_not_fooled_by_a_kind_named_in_a_message():
    line = ev.Log(level="info", source="x", message='saw "event":"Error" in a file').to_json()
    assert event_log.kind_of(line) == "Log"
    line = ev.Error(error_kind="io", source="x", message='"event":"RunStarted"').to_json()
    assert event_log.kind_of(line) == "Error"
    assert event_log.kind_marker("RunStarted") not in line.encode()  # escaped in the string


@pytest.mark.parametrize("line", ['{"ts":1.0,"level":"info"', '{"ts":1.0,"event":"Ste', "", "[]"])
def test_peek_of_a_line_that_does_not_say(line):
    assert event_log.kind_of(line) is None


def test_last_run_offset_in_a_file_holding_two_runs(tmp_path):
    path = tmp_path / "events.jsonl"
    first = [_started("first", 1.0)] + [_step(i, 2.0 + i) for i in range(300)]
    second = [_started("second", 500.0)] + [_step(i, 501.0 + i) for i in range(5)]
    writer = event_log.EventLogWriter(path)
    for e in first + second:
        writer(e)
    writer.close()
    data = path.read_bytes()
    expect = data.index(_started("second", 500.0).to_json().encode())
    with open(path, "rb") as f:
        for chunk in (1 << 20, 4096, 97, 16):  # small chunks cut the marker at their edges
            assert event_log.last_run_offset(f, len(data), chunk=chunk) == expect
        assert event_log.line_start(f, expect + 30) == expect
    assert list(event_log.read_last_run(path)) == second
    got = list(event_log.read_last_run(path, kinds={"RunStarted"}))
    assert got == second[:1]  # the other kinds passed over by their peeked kind


def test_a_file_without_run_started_is_read_from_its_start(tmp_path):
    path = tmp_path / "events.jsonl"
    path.write_text("".join(_step(i, float(i)).to_json() + "\n" for i in range(3)))
    with open(path, "rb") as f:
        assert event_log.last_run_offset(f, path.stat().st_size) == 0
    assert [e.step for e in event_log.read_last_run(path)] == [0, 1, 2]


def test_a_torn_last_line_is_skipped_and_the_next_writer_starts_a_fresh_line(tmp_path):
    path = tmp_path / "events.jsonl"
    events = [_started("r", 1.0), _step(1, 2.0)]
    torn = _step(2, 3.0).to_json()
    path.write_text("".join(e.to_json() + "\n" for e in events) + torn[: len(torn) // 2])
    assert event_log.read_events(path) == events
    unreadable = []
    assert list(event_log.read_last_run(path, on_unreadable=unreadable.append)) == events
    assert unreadable == [torn[: len(torn) // 2]]
    writer = event_log.EventLogWriter(path)
    writer(_step(3, 4.0))
    writer.close()
    assert event_log.read_events(path) == events + [_step(3, 4.0)]
    assert path.read_text().endswith(_step(3, 4.0).to_json() + "\n")


def test_events_path(tmp_path):
    assert event_log.events_path(tmp_path) == tmp_path / "events.jsonl"
    assert event_log.events_path(tmp_path / "not-yet") == tmp_path / "not-yet" / "events.jsonl"
    assert event_log.events_path(tmp_path / "node-0.jsonl") == tmp_path / "node-0.jsonl"
