"""bench/target/long_features.py: its arguments, the plan it prints, and a tiny hybrid run on
the CPU (the GPU run measures the 27B shape; this checks that the script runs and says what it
measured)."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "bench" / "target"))

from long_features import SHAPES, main, parse_args, plan_for  # noqa: E402


def test_arguments_and_their_defaults():
    args = parse_args(["--device", "cpu"])
    assert (args.shape, args.lengths, args.cap_gib, args.iters) == (
        "qwen3.6-27b", [32768, 131072], 0.0, 2)
    assert parse_args(["--device", "cpu", "--lengths", "64, 256"]).lengths == [64, 256]


@pytest.mark.parametrize("argv, says", [
    (["--lengths", "32k"], "--lengths: integers"),
    (["--lengths", "0"], "positive token counts"),
    (["--iters", "0"], "--iters must be >= 1"),
    (["--shape", "qwen9"], "invalid choice"),
])
def test_bad_arguments_exit_2_naming_the_argument(argv, says, capsys):
    with pytest.raises(SystemExit) as exc_info:
        parse_args(["--device", "cpu", *argv])
    assert exc_info.value.code == 2
    assert says in capsys.readouterr().err


def test_the_plan_grows_with_the_sample_and_counts_no_mask_for_one_row():
    short, long = (plan_for(SHAPES["qwen3.6-27b"], n, "cuda") for n in (32768, 131072))
    assert short["weights"] == long["weights"] > 50 * 2**30
    # residual stream and features are linear in tokens; one row: no padding mask
    assert long["residual stream"] == 4 * short["residual stream"]
    assert long["features"] == 4 * short["features"]
    assert "attention mask" not in long


def test_a_tiny_hybrid_target_runs_on_the_cpu(capsys):
    main(["--device", "cpu", "--shape", "tiny-hybrid", "--lengths", "48,96", "--iters", "1"])
    out = capsys.readouterr().out
    assert "tiny-hybrid" in out and "feature layers [1, 2, 3, 4, 5]" in out
    rows = [line for line in out.splitlines() if line.startswith("| 48 ") or
            line.startswith("| 96 ")]
    assert len(rows) == 2 and all("OOM" not in r for r in rows)
