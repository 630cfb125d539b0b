"""`dflash-tui check` through the CLI: exit codes and what it prints."""

import pytest

from dflash_tui.cli import main

# The demo's assets, built by the session's fixture (a fresh cache builds them beside other tests).
pytestmark = pytest.mark.usefixtures("demo_target")


def test_check_without_a_config_is_an_input_error(capsys):
    assert main(["check"]) == 2
    err = capsys.readouterr().err
    assert "nothing to check" in err and "hint: pass --config" in err


def test_check_with_a_missing_config_is_an_input_error(tmp_path, capsys):
    assert main(["check", "--config", str(tmp_path / "none.yaml")]) == 2
    assert "does not exist" in capsys.readouterr().err


def _check_demo(tmp_path, capsys, *extra: str) -> tuple[int, str]:
    from dflash_core.demo import torch_threads

    with torch_threads(1):  # a busy 2-core machine: see tests/core/check/conftest.py
        code = main(["check", "--demo", "--device", "cpu", "--output-dir", str(tmp_path),
                     "--samples", "1", "--response-tokens", "32", "--max-steps", "200",
                     "--no-reference", *extra])
    return code, capsys.readouterr().out


def test_check_demo_passes(tmp_path, dflash_cache, capsys):
    """The shipped demo end to end through the CLI: its layer_ids [0, 1, 2] stay below the
    target's last layer, so its preflight warns of nothing."""
    code, out = _check_demo(tmp_path, capsys)
    assert code == 0, out
    for phase in ("preflight", "samples:", "memorise: done", "decode:", "diagnose:"):
        assert phase in out
    assert "warning:" not in out
    assert (tmp_path / "demo" / "check" / "check.json").is_file()


def test_check_demo_finds_a_raw_last_layer(tmp_path, dflash_cache, capsys, monkeypatch):
    """The fault the check first found (on the demo's earlier layer_ids [1, 2, 3]): the last
    layer's raw output trained on, while transformers (the reference) gives it after the final
    norm: exit 1, named; the preflight first warns that the last layer is a feature at all."""
    from dflash_core.models.target.model import TargetModel

    monkeypatch.setattr(TargetModel, "_as_hidden_states", lambda self, outputs: None)
    code, out = _check_demo(tmp_path, capsys, "--set", "target.layer_ids=[1, 2, 3]")
    assert code == 1, out
    assert "warning: target.layer_ids [1, 2, 3] includes layer 3, the target's last" in out
    assert "check failed" in out
    assert "problem: target.layer_ids [3]: layer 3 is the target's last layer" in out
    assert "fix: the feature of layer i must be HF's hidden_states[i + 1]" in out


def test_check_with_a_drafter_dtype_it_cannot_run_is_one_line(tmp_path, capsys):
    """Refused after the devices are known, before the target loads or anything is written."""
    code = main(["check", "--demo", "--device", "cpu", "--output-dir", str(tmp_path),
                 "--drafter-dtype", "int8"])
    err = capsys.readouterr().err
    assert code == 2
    assert err.splitlines()[0] == "error: --drafter-dtype 'int8': use bfloat16, float16, float32"
    assert not (tmp_path / "demo").exists()


def test_check_engine_vllm_without_vllm_or_with_dspark_on_the_cpu_is_one_line(
        tmp_path, capsys, monkeypatch):
    """Refused at preflight, before the target loads or anything trains: exit 2, one line."""
    import dflash_core.eval.served as served

    args = ["check", "--demo", "--device", "cpu", "--output-dir", str(tmp_path),
            "--no-reference", "--engine", "vllm"]
    monkeypatch.setattr(served, "vllm_installed", lambda: False)
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and err[0].startswith("error: --engine vllm: vLLM is not installed")
    assert "dflash-tui[vllm]" in err[1]
    monkeypatch.setattr(served, "vllm_installed", lambda: True)
    assert main(args + ["--set", "drafter.objective=dspark"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and "vLLM cannot serve the DSpark drafter" in err[0]
    assert not (tmp_path / "demo" / "check" / "check.json").exists()
