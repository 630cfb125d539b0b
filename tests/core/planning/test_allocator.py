"""The allocator settings the engine's process runs with, and who chose them."""

from dflash_core.planning.allocator import DEFAULT_CONF, ENV_NAMES, configure_allocator
from dflash_core.pipeline.engine import Engine

from ..engine_fixtures import assets, make_config  # noqa: F401 - assets is a fixture


def test_expandable_segments_unless_the_user_chose(monkeypatch):
    for name in ENV_NAMES:
        monkeypatch.delenv(name, raising=False)
    setting = configure_allocator()
    assert setting.conf == DEFAULT_CONF == "expandable_segments:True"
    import os

    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == DEFAULT_CONF
    assert "dflash default" in setting.describe()

    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:512")
    setting = configure_allocator()
    assert setting.conf == "max_split_size_mb:512" and "PYTORCH_CUDA_ALLOC_CONF" in setting.source


def test_engine_sets_it_before_any_run(monkeypatch, tmp_path, assets):
    for name in ENV_NAMES:
        monkeypatch.delenv(name, raising=False)
    target, data = assets
    engine = Engine(make_config(tmp_path, target, data))
    assert engine.allocator.conf == DEFAULT_CONF
