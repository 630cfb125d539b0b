"""One writer per output folder: a second prepare (another process, or another thread) is
refused in one line naming the first; the lock a killed writer left is taken over with a note;
one of another host is not."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading

import pytest

from dflash_core.data.lock import OutputBusy, OutputLock, lock_path
from dflash_core.data.prepare import PrepareOptions, prepare
from dflash_core.demo.chat import write_demo_conversations

HOLD = ("import sys; from dflash_core.data.lock import OutputLock; "
        "OutputLock(sys.argv[1], 'prepare').acquire(); print('held', flush=True); "
        "sys.stdin.read()")


def _holder(out):
    """Another process holding the lock of ``out`` until its stdin closes."""
    p = subprocess.Popen([sys.executable, "-c", HOLD, str(out)], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "held"
    return p


def test_a_second_process_is_refused_naming_the_first_then_a_dead_ones_lock_is_taken_over(
        tmp_path, capsys):
    from dflash_tui.cli import main

    src = write_demo_conversations(tmp_path / "demo.jsonl", n=4)
    out = tmp_path / "data"
    argv = ["data", "prepare", str(src), "--tokenizer", "builtin:tiny", "--out", str(out),
            "--quiet", "--workers", "1"]
    p = _holder(out)
    try:
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert f"pid {p.pid} on {socket.gethostname()}" in err and "another process" in err
        assert "hint: wait for it to finish, or pass another --out" in err
        assert not out.exists()
    finally:
        p.kill()  # killed: its lock file stays, its flock goes
        p.wait()
    assert json.loads(lock_path(out).read_text())["pid"] == p.pid
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert f"took over the lock of {out}" in err and f"pid {p.pid}" in err
    assert "no longer running" in err
    assert not lock_path(out).exists()  # released


def test_two_prepares_at_once_in_threads_one_is_refused_the_other_finishes(tmp_path,
                                                                          monkeypatch):
    import dflash_core.data.prepare as prep

    src = write_demo_conversations(tmp_path / "demo.jsonl", n=4)
    inside, go_on = threading.Event(), threading.Event()
    real = prep._prepare_into

    def slow(*a, **k):  # the first prepare waits, holding the lock, until the second tried
        inside.set()
        go_on.wait(30)
        return real(*a, **k)

    monkeypatch.setattr(prep, "_prepare_into", slow)
    opts = PrepareOptions(src, tmp_path / "data", workers=1, progress=False)
    results: list = []
    t = threading.Thread(target=lambda: results.append(prepare(opts)))
    t.start()
    assert inside.wait(30)
    with pytest.raises(OutputBusy, match=f"pid {os.getpid()}"):
        prepare(opts)
    go_on.set()
    t.join(30)
    assert results and results[0]["counts"]["samples"] == 4
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["data", "demo.jsonl"]  # no lock, no partial folder left beside it


def test_a_lock_file_of_another_host_is_not_taken_over(tmp_path):
    out = tmp_path / "data"
    lock_path(out).write_text(json.dumps({"verb": "prepare", "pid": 1, "host": "node-elsewhere",
                                          "started": 0}))
    with pytest.raises(OutputBusy, match="node-elsewhere") as e:
        OutputLock(out, "prepare").acquire()
    assert str(lock_path(out)) in e.value.hint
    assert "node-elsewhere" in lock_path(out).read_text()  # left as it was


def test_a_lock_beside_a_folder_that_cannot_be_written_is_one_line(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(Exception) as e:
        OutputLock(tmp_path / "file" / "data", "prepare").acquire()
    assert "cannot create the lock file" in str(e.value) and e.value.hint
