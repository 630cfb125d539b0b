"""`dflash-tui eval` through the CLI: the table, exit codes, and one line per bad input."""

import json

import pytest

from dflash_tui.cli import main
from tests.core.eval.conftest import (  # noqa: F401  (fixtures)
    demo_eval, demo_hf_config, module_thread, one_thread, save_dflash,
)


def _args(demo_eval, out, *extra):
    args = ["eval", "--target", str(demo_eval["target"]), "--device", "cpu", "--out", str(out),
            "--max-new-tokens", "16", "--batch", "3"]
    for d in demo_eval["drafters"]:
        args += ["--drafter", str(d)]
    for k, v in demo_eval["sets"].items():
        args += ["--prompts", f"{k}={v}"]
    return args + list(extra)


def test_two_sets_two_drafters_in_one_table_per_set(demo_eval, tmp_path, capsys):
    assert main(_args(demo_eval, tmp_path)) == 0
    cap = capsys.readouterr()
    for name in ("chat", "plain"):
        assert f"set {name} (5 prompts)" in cap.out
    header = next(line for line in cap.out.splitlines() if line.strip().startswith("plain"))
    assert header.split() == ["plain", "d1", "d2"]
    for row in ("tau", "accepted@1", "accepted@4", "rounds", "tokens/s", "speedup"):
        assert any(line.startswith(row) for line in cap.out.splitlines()), row
    lossless = [line.split() for line in cap.out.splitlines() if line.startswith("lossless")]
    assert lossless == [["lossless", "-", "exact", "exact"]] * 2
    assert "chat: 3/5 prompts" in cap.err and "chat: 5/5 prompts" in cap.err  # progress
    assert json.loads((tmp_path / "results.json").read_text())["sets"]["plain"]["prompts"] == 5
    # run again: everything was measured; the same table from the files
    assert main(_args(demo_eval, tmp_path)) == 0
    again = capsys.readouterr()
    assert "all 5 prompts measured before" in again.err
    assert again.out.split("results in")[0] == cap.out.split("results in")[0]


@pytest.mark.parametrize("tie", [False, True], ids=["clear", "near-tie"])
def test_a_broken_acceptance_fails_the_lossless_check(demo_eval, tmp_path, capsys,
                                                      monkeypatch, tie):
    from dflash_core.eval import runner, spec_decode

    honest = spec_decode.greedy_accept
    monkeypatch.setattr(spec_decode, "greedy_accept",
                        lambda d, p: min(len(d), honest(d, p) + 1))
    if tie:  # every difference called a near tie: reported, not a failure
        monkeypatch.setitem(runner.NEAR_TIE, "float32", 1e9)
    assert main(_args(demo_eval, tmp_path)) == (0 if tie else 1)
    cap = capsys.readouterr()
    if tie:
        assert ("note: 20 decodings (prompt, drafter) parted from the target's greedy output "
                "at a near tie") in cap.err
        assert "near ties" in cap.out and "lossless check failed" not in cap.err
        return
    assert "lossless check failed: set chat, drafter d1: prompt c" in cap.err
    assert "leaves the target's greedy output at new token" in cap.err
    assert "differ (first: c" in cap.out


def test_bad_inputs_exit_2_with_one_line(demo_eval, tmp_path, capsys, demo_hf_config):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    assert main(_args(demo_eval, tmp_path / "o1", "--prompts", f"x={empty}")) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[0] == f"error: prompt set x: {empty} holds no prompts" and err[1].startswith("hint:")

    assert main(_args(demo_eval, tmp_path / "o2", "--thinking", "off")) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith("error: --thinking off: the chat template of")
    assert err[0].endswith("has no thinking switch (no enable_thinking variable)")

    cfg = demo_hf_config.to_dict() | {"num_hidden_layers": 8, "layer_types": None}
    from transformers import Qwen3Config

    other = save_dflash(tmp_path / "deep", Qwen3Config(**{k: v for k, v in cfg.items()
                                                           if k != "model_type"}), 0)
    assert main(_args(demo_eval, tmp_path / "o3", "--drafter", str(other))) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[0] == (f"error: --drafter {other} was trained for another target: "
                      "8 target layers (this one has 4)")
    assert not any((tmp_path / o).exists() for o in ("o1", "o2", "o3"))
