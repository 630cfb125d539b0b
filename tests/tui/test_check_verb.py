"""`dflash-tui check` through the CLI: exit codes and what it prints."""

import pytest

from dflash_tui.cli import main


def test_check_without_a_config_is_an_input_error(capsys):
    assert main(["check"]) == 2
    err = capsys.readouterr().err
    assert "nothing to check" in err and "hint: pass --config" in err


def test_check_with_a_missing_config_is_an_input_error(tmp_path, capsys):
    assert main(["check", "--config", str(tmp_path / "none.yaml")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_check_demo_finds_the_demo_layer_ids(tmp_path, dflash_cache, capsys):
    """The shipped demo end to end through the CLI. Its target.layer_ids [1, 2, 3] end at the
    target's last layer, which transformers (and so the reference and serving) returns after the
    final norm while the engine trains on the raw output: a real disagreement, exit 1."""
    from dflash_core.demo import torch_threads

    with torch_threads(1):  # a busy 2-core machine: see tests/core/check/conftest.py
        code = main(["check", "--demo", "--device", "cpu", "--output-dir", str(tmp_path),
                     "--samples", "1", "--response-tokens", "32", "--max-steps", "200",
                     "--no-reference"])
    out = capsys.readouterr().out
    assert code == 1, out
    for phase in ("preflight", "samples:", "memorise: done", "decode:", "diagnose:",
                  "check failed"):
        assert phase in out
    assert "problem: target.layer_ids [3]: layer 3 is the target's last layer" in out
    assert "fix: list only layers below the last one" in out
    assert (tmp_path / "demo" / "check" / "check.json").is_file()
