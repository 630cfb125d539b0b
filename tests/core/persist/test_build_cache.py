"""The build cache: where it lives, and builds that fail, race or wait leave only whole folders."""

import threading
import time

import pytest

from dflash_core.persist.build_cache import build_lock, cache_root, cached_build

MARKER = "built.json"  # what a finished build writes last


def test_cache_root_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("DFLASH_CACHE", str(tmp_path / "x"))
    assert cache_root() == tmp_path / "x"
    monkeypatch.delenv("DFLASH_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_root() == tmp_path / "xdg" / "dflash"
    assert cache_root(tmp_path / "given") == tmp_path / "given"


def test_failed_build_leaves_nothing(tmp_path):
    final = tmp_path / "cache" / "thing"

    def build(tmp):
        tmp.mkdir()
        (tmp / "half").write_text("x")
        raise RuntimeError("killed mid-build")

    with pytest.raises(RuntimeError):
        cached_build(final, build, marker=MARKER)
    assert not final.exists()
    assert [p.name for p in final.parent.iterdir() if not p.name.endswith(".lock")] == []


def test_racing_builds_build_once(tmp_path):
    final = tmp_path / "cache" / "thing"
    calls = []

    def build(tmp):
        calls.append(1)
        tmp.mkdir()
        time.sleep(0.3)
        (tmp / MARKER).write_text("{}")

    results = []
    threads = [threading.Thread(
        target=lambda: results.append(cached_build(final, build, marker=MARKER)))
        for _ in range(3)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert results == [final] * 3 and len(calls) == 1
    assert (final / MARKER).is_file()
    assert not list(final.parent.glob(".tmp-*"))


def test_waiting_for_another_build_can_be_aborted(tmp_path):
    """A build waits for the lock holder, reporting progress; a progress callback that raises (the
    engine's stop request) ends the wait."""
    final = tmp_path / "cache" / "thing"
    final.parent.mkdir(parents=True)

    class Stop(Exception):
        pass

    def stop(fraction, message):
        assert "waiting" in message
        raise Stop

    with build_lock(final):  # another builder holds it
        with pytest.raises(Stop):
            cached_build(final, lambda tmp: pytest.fail("must not build"), stop, marker=MARKER)
    assert not final.exists()
