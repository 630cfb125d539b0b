"""bench/training/drafter_step.py: its arguments, the FLOPs DSpark's loss adds, and tiny-shape
runs on the CPU with --objective dspark (the GPU run measures the real shapes; this checks that
the script runs through the engine's trainer and prints the step time next to the plan)."""

import re
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "bench" / "training"))

from drafter_step import SHAPES, main, parse_args, run_config, size, step_flops  # noqa: E402

from dflash_core.planning.memory import plan_memory  # noqa: E402

TINY = ["--device", "cpu", "--shapes", "tiny", "--seq-len", "48", "--anchors", "4",
        "--samples", "2", "--layers", "1"]


def test_dspark_takes_the_configs_dspark_defaults_and_the_flags_override_them():
    args = parse_args([*TINY, "--objective", "dspark"])
    assert (args.block_size, args.loss_chunk, args.markov_rank) == (7, 1024, 256)
    args = parse_args([*TINY, "--objective", "dspark", "--block-size", "5", "--loss-chunk",
                       "64", "--markov-rank", "32"])
    assert (args.block_size, args.loss_chunk, args.markov_rank) == (5, 64, 32)
    cfg = run_config(args, 96)
    assert (cfg.drafter.objective, cfg.drafter.block_size, cfg.drafter.markov_rank) == (
        "dspark", 5, 32)
    args = parse_args(TINY)  # DFlash keeps this figure's own block 16 and chunk 8192
    assert (args.objective, args.block_size, args.loss_chunk) == ("dflash", 16, 8192)


@pytest.mark.parametrize("argv, says", [
    (["--markov-rank", "64"], "--markov-rank is DSpark's"),
    (["--objective", "dspark", "--loss", "dpace"], "drafter.loss: dpace does not combine"),
    (["--objective", "dspark", "--markov-rank", "0"], "drafter.markov_rank"),
    (["--objective", "dspark", "--markov-rank", "1000"], "exceeds the target's vocabulary"),
    (["--shapes", "70B"], "unknown ['70B']"),
    (["--steps", "0"], "--steps must be >= 1"),
    (["--time-loss", "--batches", "2x64"], "give one of them"),
    (["--batches", "2x64,4y32"], "expected ROWSxLENGTH"),
    (["--fused-loss", "on"], "--fused-loss on: on needs the drafters on CUDA GPUs"),
    (["--fused-loss", "fast"], "invalid choice: 'fast'"),
])
def test_bad_arguments_exit_2_naming_the_cause(argv, says, capsys):
    with pytest.raises(SystemExit) as exc_info:
        parse_args([*TINY, *argv])
    assert exc_info.value.code == 2
    assert says in capsys.readouterr().err


def test_cuda_without_a_gpu_points_at_the_cpu_smoke_run(capsys, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit):
        parse_args(["--shapes", "8B"])
    assert "--device cpu --shapes tiny" in capsys.readouterr().err


def test_dsparks_flop_count_adds_its_losss_matmuls():
    dc = SimpleNamespace(hidden_size=4096, head_dim=128, num_attention_heads=32,
                         num_key_value_heads=8, num_hidden_layers=5, intermediate_size=12288)
    n, S, A, B, V, r, H = 8, 3072, 512, 7, 151936, 256, 4096
    dflash = step_flops(dc, n, S, A, B, V)
    dspark = step_flops(dc, n, S, A, B, V, objective="dspark", rank=r)
    assert set(dflash) == {"drafter", "lm_head"}
    assert dspark["drafter"] == dflash["drafter"]
    rows = A * B  # every DSpark slot predicts; DFlash's anchor slot does not
    assert dspark["lm_head"] == pytest.approx(dflash["lm_head"] * B / (B - 1))
    assert dspark["target lm_head"] == pytest.approx(n * 2 * rows * H * V)  # forward only
    assert dspark["markov head"] == pytest.approx(3 * n * 2 * rows * r * V)
    assert dspark["confidence head"] == pytest.approx(3 * n * 2 * rows * (H + r))
    no_conf = step_flops(dc, n, S, A, B, V, objective="dspark", rank=r, confidence=False)
    assert "confidence head" not in no_conf


def test_a_tiny_dspark_run_on_the_cpu_prints_the_step_time_and_the_plan(capsys):
    argv = [*TINY, "--objective", "dspark", "--steps", "1", "--warmup", "1"]
    main(argv)
    out = capsys.readouterr().out
    steps = re.findall(r"tiny step (\d): ([0-9.]+) s, loss ([0-9.]+) \(ce ([0-9.]+), tv "
                       r"([0-9.]+), conf ([0-9.]+)\)", out)
    assert [s[0] for s in steps] == ["0", "1"]
    assert all(float(x) > 0 for s in steps for x in s[2:])  # DSpark's three terms, trained
    row = next(x for x in out.splitlines() if x.startswith("| tiny-shaped drafter, dspark (B 7, "
                                                           "Markov rank 256), adamw, torch loss"))
    step = float(re.search(r"\| step ([0-9.]+) s, of it optimizer", row).group(1))
    assert step == pytest.approx(float(steps[1][1]), abs=0.006)  # the timed step, unrounded
    # 2 samples in the step; the row prints the step rounded to its 3 decimals at most, so the
    # rate lies between what the rounded step's ends give
    rate = float(re.search(r"\| ([0-9.]+) samples/s", row).group(1))
    decimals = len(re.search(r"\| step [0-9]+\.?([0-9]*) s", row).group(1))
    half = 0.5 * 10 ** -decimals
    assert 2 / (step + half) * 0.99 <= rate <= 2 / max(step - half, 1e-9) * 1.01
    # the plan printed is the drafter GPU's plan of this very config (DSpark's loss chunk in it)
    args = parse_args(argv)
    plan = {r.device: r for r in plan_memory(run_config(args, 2 * 48), SHAPES["tiny"]).rows}
    assert f"| plan {size(plan['cuda:0'].total)} (tensors " in row
    assert f"of it loss chunk {size(plan['cuda:0'].components['loss chunk'])}" in out
    assert re.search(r"FLOPs per step [0-9.e-]+ TFLOP \(drafter .*target lm_head .*markov "
                     r"head .*confidence head", out)


def test_time_loss_sets_dsparks_loss_against_dflashs_ce_over_the_same_rows(capsys):
    main([*TINY, "--objective", "dspark", "--time-loss", "--steps", "1", "--warmup", "1"])
    out = capsys.readouterr().out
    rows = {}
    for name in ("DSpark CE+TV+conf", "DFlash chunked CE, same rows"):
        cells = [c.strip() for c in next(x for x in out.splitlines()
                                         if x.startswith(f"| {name} |")).split("|")[1:-1]]
        rows[name] = int(cells[1]), float(cells[3])
        assert cells[2] == "1024" and float(cells[3]) > 0
        assert cells[-1] == "torch"  # --fused-loss auto on the CPU: the torch loss
    dspark, dflash = rows.values()
    assert dspark[0] == dflash[0] > 0  # the same labelled slots
    ratio = float(re.search(r"DSpark's loss costs ([0-9.]+)x DFlash's chunked CE", out).group(1))
    assert ratio == pytest.approx(dspark[1] / dflash[1], rel=0.05)
