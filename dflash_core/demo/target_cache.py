"""The demo target in the build cache, built once per recipe, and its copy in a run folder."""

from __future__ import annotations

import contextlib
import os
import shutil
import uuid
from pathlib import Path

import dflash_core.demo.recipe as recipe
from dflash_core.demo.corpus import corpus_digest
from dflash_core.demo.recipe import BUILD_THREADS, META_NAME, TRAIN_STEPS
from dflash_core.demo.tiny_target import build_tiny_target, read_meta
from dflash_core.persist.build_cache import Progress, cache_root, cached_build, is_built, report


def tiny_target_key(seed: int = 0, steps: int = TRAIN_STEPS) -> str:
    return f"{recipe.DEMO_VERSION}-{corpus_digest()}-s{seed}-n{steps}-t{BUILD_THREADS}"


def ensure_tiny_target(cache_dir: str | Path | None = None, progress: Progress | None = None,
                       *, seed: int = 0, steps: int = TRAIN_STEPS) -> Path:
    """The cached demo target folder, built on first use."""
    final = cache_root(cache_dir) / "targets" / tiny_target_key(seed, steps)
    if is_built(final, META_NAME):
        report(progress, 1.0, f"demo target cached at {final}")
        return final
    return cached_build(final, lambda tmp: build_tiny_target(tmp, progress, seed, steps), progress,
                        marker=META_NAME)


def install_target(run_dir: str | Path, cache_dir: str | Path | None = None,
                   progress: Progress | None = None) -> Path:
    """Copy the cached demo target into ``<run_dir>/target/`` (the run folder layout other tools
    rely on) and return that path. An up-to-date copy is kept as it is.

    Several nodes sharing one run folder install it at the same moment, with no lock that
    reaches across machines: each copies into its own temporary folder, and when the rename
    finds the winner's copy in place the loser keeps that one (complete, and of the same
    target). An out-of-date copy is renamed aside and then deleted, never deleted in place."""
    src = ensure_tiny_target(cache_dir, progress)
    dst = Path(run_dir) / "target"

    def current() -> bool:
        try:
            return is_built(dst, META_NAME) and read_meta(dst) == read_meta(src)
        except FileNotFoundError:  # another node renamed an old copy aside as it was read
            return False

    if current():
        return dst
    dst.parent.mkdir(parents=True, exist_ok=True)
    tag = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp, old = dst.parent / f".tmp-target-{tag}", dst.parent / f".old-target-{tag}"
    try:
        shutil.copytree(src, tmp)
        if dst.exists() and not current():
            with contextlib.suppress(FileNotFoundError):  # another node moved it first
                os.rename(dst, old)
        try:
            os.rename(tmp, dst)
        except OSError:
            if not current():  # what is there must be the winner's complete copy
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(old, ignore_errors=True)
    return dst
