"""bench/target/moe_target.py: its arguments, and a tiny-shape run on the CPU (the GPU run
measures the real shapes; this checks that the script runs and says what it measured)."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "bench" / "target"))

from moe_target import HEADER, SHAPES, main, parse_args  # noqa: E402


def test_arguments_and_their_defaults():
    args = parse_args(["--device", "cpu"])
    assert args.shapes == ["qwen3-30b-a3b", "gpt-oss-20b"]
    assert (args.tokens, args.batch, args.cap_gib, args.attn) == (2048, 16, 0.0, ["auto"])
    args = parse_args(["--device", "cpu", "--shapes", "tiny-moe, tiny-gpt-oss", "--cap-gib", "95",
                       "--attn", "eager,flex_attention"])
    assert args.shapes == ["tiny-moe", "tiny-gpt-oss"] and args.cap_gib == 95.0
    assert args.attn == ["eager", "flex_attention"]
    # the real shapes are the releases' own config.json keys
    assert SHAPES["qwen3-30b-a3b"]["num_experts"] == 128
    assert SHAPES["gpt-oss-20b"]["num_local_experts"] == 32


@pytest.mark.parametrize("argv, says", [
    (["--shapes", "qwen3-moe"], "unknown ['qwen3-moe']"),
    (["--tokens", "0"], "--tokens must be >= 1"),
    (["--batch", "-1"], "--batch must be >= 1"),
    (["--cap-gib", "-5"], "--cap-gib must be >= 0"),
    (["--shapes", ""], "--shapes"),
])
def test_bad_arguments_exit_2_naming_the_argument(argv, says, capsys):
    with pytest.raises(SystemExit) as exc_info:
        parse_args(["--device", "cpu", *argv])
    assert exc_info.value.code == 2
    assert says in capsys.readouterr().err


def test_cuda_without_a_gpu_points_at_the_cpu_smoke_run(capsys, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit):
        parse_args([])
    assert "--device cpu" in capsys.readouterr().err


def test_a_tiny_run_on_the_cpu_measures_both_and_checks_the_features(capsys):
    rows = main(["--device", "cpu", "--shapes", "tiny-moe,tiny-gpt-oss", "--tokens", "32",
                 "--batch", "2", "--iters", "1"])
    out = capsys.readouterr().out
    assert len(rows) == 2 and HEADER in out
    moe, oss = ([c.strip() for c in row.split("|")[1:-1]] for row in rows)
    assert moe[:3] == ["tiny-moe", "sdpa", "2x32"]
    assert oss[:3] == ["tiny-gpt-oss", "eager", "2x32"]  # preflight's choice, said above it
    assert "GptOssForCausalLM cannot run sdpa" in out
    for cells in (moe, oss):
        plain, engine, ratio = (float(c.replace(",", "")) for c in cells[3:6])
        assert plain > 0 and engine > 0 and ratio == pytest.approx(engine / plain, rel=0.05)
        assert float(cells[8]) > 0  # the plan of the batch
    assert out.count("= the plain forward's hidden states: max difference 0.00e+00") == 2
