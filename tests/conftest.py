"""Shared fixtures. The demo target and its data are built once per test session (and kept in the
pytest cache between sessions). A fresh cache (CI's) builds them in a child process while the
tests that need neither run: the ~2 minute build (one thread) takes the second core instead of
holding up the first test that needs it."""

import contextlib
import fcntl
import os
import subprocess
import sys
from pathlib import Path

import pytest

DEMO_FIXTURES = {"demo_target", "demo_data"}
_CACHE = pytest.StashKey[Path]()
_BUILDER = pytest.StashKey[subprocess.Popen]()
# The child process: build (or find cached) the demo target, then its data set, holding the
# cache's build lock (build_lock) so that a test process that needs them waits instead of
# building them again.
_BUILD = ("import fcntl, sys\n"
          "from dflash_core.demo import ensure_demo_data, ensure_tiny_target\n"
          "lock = open(sys.argv[2], 'a')\n"
          "fcntl.flock(lock, fcntl.LOCK_EX)\n"
          "ensure_demo_data(ensure_tiny_target(sys.argv[1]), sys.argv[1])\n")


def cache_root(config) -> Path:
    """Where ``builtin:`` assets are cached during tests: $DFLASH_CACHE when set, else a folder in
    the pytest cache (a session temp folder with -p no:cacheprovider)."""
    if _CACHE not in config.stash:
        env = os.environ.get("DFLASH_CACHE")
        cache = getattr(config, "cache", None)
        if env:
            root = Path(env)
        elif cache is not None:
            root = Path(cache.mkdir("dflash"))
        else:
            root = config._tmp_path_factory.mktemp("dflash-cache")
        config.stash[_CACHE] = root
    return config.stash[_CACHE]


@pytest.hookimpl(trylast=True)  # after -m / -k have deselected
def pytest_collection_modifyitems(config, items):
    """The modules that use the demo's assets run last (each module kept whole, its fixtures set
    up once), and a child process starts building the assets now."""
    needs = {getattr(item, "module", None) for item in items
             if DEMO_FIXTURES & set(getattr(item, "fixturenames", ()))}
    needs.discard(None)
    if not needs:
        return
    items.sort(key=lambda item: getattr(item, "module", None) in needs)  # stable
    # Under pytest-xdist (make test's -n 2) every worker collects: the first one builds, and
    # the workers step back (nice) so that the build, which the demo's tests wait for, keeps a
    # core of its own instead of a third of two (measured: both workers then waited ~3 min).
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if worker is not None and worker != "gw0":
        os.nice(5)
        return
    root = cache_root(config)
    root.mkdir(parents=True, exist_ok=True)
    with open(root / "build.log", "wb") as log:
        config.stash[_BUILDER] = subprocess.Popen(
            [sys.executable, "-c", _BUILD, str(root), str(root / "build.lock")], stdout=log,
            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            env={**os.environ, "DFLASH_CACHE": str(root)})
    if worker is not None:
        os.nice(5)  # after the start: the builder keeps the niceness it was started with


def pytest_sessionfinish(session):
    builder = session.config.stash.get(_BUILDER, None)
    if builder is not None and builder.poll() is None:  # no demo test ran (-x, an interrupt)
        builder.kill()
        builder.wait()


@pytest.fixture(scope="session", autouse=True)
def dflash_cache(request) -> Path:
    """The asset cache (cache_root), exported as DFLASH_CACHE so an engine started by a test
    finds the same assets instead of building them in the home folder."""
    root = cache_root(request.config)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DFLASH_CACHE", str(root))
        yield root


@pytest.fixture(scope="session")
def demo_target(request, dflash_cache) -> Path:
    """The built-in demo target (a trained tiny byte-level Qwen3), as an HF folder."""
    from dflash_core.demo import ensure_tiny_target

    builder = request.config.stash.get(_BUILDER, None)
    if builder is not None:
        builder.wait()  # had it failed, the build below runs again here and raises its error
    with build_lock(dflash_cache):  # another worker's builder, while it builds
        return ensure_tiny_target(dflash_cache)


@contextlib.contextmanager
def build_lock(root: Path):
    root.mkdir(parents=True, exist_ok=True)
    with open(root / "build.lock", "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield


@pytest.fixture(scope="session")
def demo_data(demo_target, dflash_cache) -> Path:
    """The built-in demo data set: held-out prompts + the demo target's greedy responses."""
    from dflash_core.demo import ensure_demo_data

    with build_lock(dflash_cache):
        return ensure_demo_data(demo_target, dflash_cache)


@pytest.fixture(scope="session")
def _hf_modules_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("hf-modules")


@pytest.fixture
def hf_modules_cache(_hf_modules_root, monkeypatch) -> Path:
    """Where transformers copies a folder's own Python code (auto_map) for a test: ONE folder for
    the whole session. Python imports ``transformers_modules`` from the first such folder on
    sys.path, so a second folder in the same process would hide the modules copied into it."""
    import transformers.dynamic_module_utils as dmu

    monkeypatch.setattr(dmu, "HF_MODULES_CACHE", str(_hf_modules_root))
    return _hf_modules_root
