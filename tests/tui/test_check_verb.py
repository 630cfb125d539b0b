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


def test_check_demo_passes(tmp_path, dflash_cache, capsys):
    from dflash_core.demo import torch_threads

    """The demo end to end through the CLI (without the reference: the demo's own layer ids end
    at the target's last layer, which the reference reads after the final norm)."""
    with torch_threads(1):  # a busy 2-core machine: see tests/core/check/conftest.py
        code = main(["check", "--demo", "--device", "cpu", "--output-dir", str(tmp_path),
                     "--samples", "1", "--response-tokens", "32", "--max-steps", "200",
                     "--no-reference"])
    out = capsys.readouterr().out
    assert code == 0, out
    for phase in ("preflight", "samples:", "memorise: done", "decode:", "diagnose:",
                  "check passed"):
        assert phase in out
    assert (tmp_path / "demo" / "check" / "check.json").is_file()
