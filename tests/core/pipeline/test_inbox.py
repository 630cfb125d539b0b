"""Command files from an attached dashboard reach the controller once, in order; stale, unknown
and failing ones are reported, never acted on twice."""

from __future__ import annotations

import threading
import time

import pytest

from dflash_core.observe.events import Error, Log
from dflash_core.pipeline.inbox import CommandInbox, command_dir, send_command


class FakeController:
    def __init__(self, fail: str | None = None):
        self.calls: list[str] = []
        self.fail = fail
        self.called = threading.Event()

    def abort(self):
        self._call("abort")

    def restart(self):
        self._call("restart")

    def shutdown(self, timeout=30.0):
        self._call("shutdown")

    def _call(self, name):
        self.calls.append(name)
        self.called.set()
        if name == self.fail:
            raise RuntimeError(f"{name} broke")


def make(tmp_path, **kw):
    ctl, events = FakeController(**kw), []
    return ctl, events, CommandInbox(ctl, tmp_path, events.append, poll_s=0.05)


def test_commands_are_dispatched_once_in_order_and_removed(tmp_path):
    ctl, events, inbox = make(tmp_path)
    send_command(tmp_path, "restart")
    send_command(tmp_path, "abort")
    assert inbox.poll_once() == ["restart", "abort"]
    assert ctl.calls == ["restart", "abort"]
    assert list(command_dir(tmp_path).iterdir()) == []
    assert inbox.poll_once() == [] and ctl.calls == ["restart", "abort"]
    assert [e.message for e in events] == ["restart requested by an attached dashboard",
                                           "abort requested by an attached dashboard"]


def test_files_left_by_an_earlier_process_are_dropped_unread(tmp_path):
    ctl, events, inbox = make(tmp_path)
    send_command(tmp_path, "abort")  # from a dashboard attached to a run that has since ended
    inbox.start()
    try:
        time.sleep(0.3)
        assert ctl.calls == []
        assert any(isinstance(e, Log) and "left from an earlier process" in e.message
                   for e in events)
        send_command(tmp_path, "abort")  # a new one is served
        assert ctl.called.wait(2)
        assert ctl.calls == ["abort"]
    finally:
        inbox.close()
    assert not inbox._thread.is_alive()


def test_unknown_and_half_written_files_are_not_commands(tmp_path):
    ctl, events, inbox = make(tmp_path)
    folder = command_dir(tmp_path)
    folder.mkdir()
    (folder / "123-1-shutdown").write_text("shutdown\n")  # the owner's alone
    (folder / "124-1-abort.tmp").write_text("abort\n")  # still being written
    assert inbox.poll_once() == []
    assert ctl.calls == []
    assert [e.level for e in events] == ["warning"] and "not one of" in events[0].message
    assert [p.name for p in folder.iterdir()] == ["124-1-abort.tmp"]
    with pytest.raises(ValueError, match="unknown remote command"):
        send_command(tmp_path, "shutdown")


def test_a_failing_command_is_reported_and_the_inbox_goes_on(tmp_path):
    ctl, events, inbox = make(tmp_path, fail="restart")
    send_command(tmp_path, "restart")
    send_command(tmp_path, "abort")
    assert inbox.poll_once() == ["restart", "abort"]
    (err,) = [e for e in events if isinstance(e, Error)]
    assert not err.fatal and "restart broke" in err.message
    assert ctl.calls == ["restart", "abort"]
