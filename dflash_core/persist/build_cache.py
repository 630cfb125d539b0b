"""A cache of folders that are built once and then reused (the demo's target and data).

The cache lives in ``$DFLASH_CACHE``, else ``$XDG_CACHE_HOME/dflash``, else ``~/.cache/dflash``; the
caller names each folder with a key that changes whenever what it holds would. A build goes to a
temporary folder that is renamed into place, under an exclusive lock across processes: a crash or a
second process never leaves a half-built folder behind, and a second process waits for the first
build instead of repeating it. A folder counts as built once it holds its marker file, which the
build writes last.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import time
import uuid
from pathlib import Path
from typing import Callable, Iterator

Progress = Callable[[float, str], None]  # progress(fraction in [0, 1], message)


def cache_root(cache_dir: str | Path | None = None) -> Path:
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    if os.environ.get("DFLASH_CACHE"):
        return Path(os.environ["DFLASH_CACHE"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base).expanduser() / "dflash"


def report(progress: Progress | None, fraction: float, message: str) -> None:
    """Call ``progress`` (when there is one) with the fraction clamped to [0, 1]."""
    if progress is not None:
        progress(min(1.0, max(0.0, fraction)), message)


def is_built(folder: Path, marker: str) -> bool:
    return (folder / marker).is_file()


@contextlib.contextmanager
def build_lock(final: Path, waiting: Callable[[], None] | None = None) -> Iterator[None]:
    """The lock a build of ``final`` holds: exclusive across processes (POSIX flock), so a second
    process waits for the first build instead of repeating it. Without flock the atomic rename
    alone keeps things correct. While it waits it calls ``waiting()`` every half second (a progress
    callback that may raise to abort: the wait never blocks a stop request)."""
    try:
        import fcntl
    except ImportError:  # not POSIX
        yield
        return
    path = final.parent / f".{final.name}.lock"
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as fh:
        while True:
            try:
                fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if waiting is not None:
                    waiting()
                time.sleep(0.5)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def cached_build(final: Path, build: Callable[[Path], None], progress: Progress | None = None,
                 *, marker: str) -> Path:
    """``final`` if it is already built; else ``build(tmp)`` and rename tmp to ``final``. A build
    must write ``marker`` into its folder once it is complete."""
    if is_built(final, marker):
        return final
    final.parent.mkdir(parents=True, exist_ok=True)

    def waiting() -> None:
        report(progress, 0.0, f"waiting for another process building {final.name}")

    with build_lock(final, waiting):
        if is_built(final, marker):
            return final
        # Under the lock, temporary folders of this key are leftovers of a killed build.
        for old in final.parent.glob(f".tmp-{final.name}-*"):
            shutil.rmtree(old, ignore_errors=True)
        tmp = final.parent / f".tmp-{final.name}-{uuid.uuid4().hex[:8]}"
        try:
            build(tmp)
            _publish(tmp, final, marker)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)  # only left when the build failed
    return final


def _publish(tmp: Path, final: Path, marker: str) -> None:
    """Rename a finished build into place; if another process got there first, keep theirs."""
    try:
        os.rename(tmp, final)
    except OSError:
        if not is_built(final, marker):
            raise
        shutil.rmtree(tmp, ignore_errors=True)
