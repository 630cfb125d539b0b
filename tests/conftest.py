"""Shared fixtures. The demo target and its data are built once per test session (and kept in the
pytest cache between sessions; CI starts empty and pays the ~2 minute build once)."""

import os
from pathlib import Path

import pytest


@pytest.fixture(scope="session", autouse=True)
def dflash_cache(request, tmp_path_factory) -> Path:
    """Where ``builtin:`` assets are cached during tests: $DFLASH_CACHE when set, else a folder in
    the pytest cache (a session temp folder with -p no:cacheprovider). Exported as DFLASH_CACHE so
    an engine started by a test finds the same assets instead of building them in the home folder.
    """
    env = os.environ.get("DFLASH_CACHE")
    cache = getattr(request.config, "cache", None)
    if env:
        root = Path(env)
    elif cache is not None:
        root = Path(cache.mkdir("dflash"))
    else:
        root = tmp_path_factory.mktemp("dflash-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DFLASH_CACHE", str(root))
        yield root


@pytest.fixture(scope="session")
def demo_target(dflash_cache) -> Path:
    """The built-in demo target (a trained tiny byte-level Qwen3), as an HF folder."""
    from dflash_core.demo import ensure_tiny_target

    return ensure_tiny_target(dflash_cache)


@pytest.fixture(scope="session")
def demo_data(demo_target, dflash_cache) -> Path:
    """The built-in demo data set: held-out prompts + the demo target's greedy responses."""
    from dflash_core.demo import ensure_demo_data

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
