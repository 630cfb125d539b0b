"""bench/training/plan_vs_peak.py: its arguments, the phases it marks in a replica's step, and a
tiny-shape run on the CPU (the GPU run measures the real shapes; this checks that the script runs
through the engine's trainer, reports every case, and leaves out the ones the plan refuses)."""

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "bench" / "training"))

from plan_vs_peak import PhasePeaks, build, case_config, main, parse_args  # noqa: E402

from dflash_core.models.training.replica import prepare_batch  # noqa: E402

TINY = ["--device", "cpu", "--shapes", "tiny", "--anchors", "8"]


@pytest.mark.parametrize("argv, says", [
    (["--shapes", "70B"], "unknown ['70B']"),
    (["--objectives", "eagle"], "unknown ['eagle']"),
    (["--lengths", "8k"], "expected tokens"),
    (["--lengths", "1"], "2+ tokens"),
    (["--micro", "0"], "--micro must be > 0"),
    (["--objectives", "dspark", "--anchors-per-1k", "-1"], "must be >= 0"),
])
def test_bad_arguments_exit_2_naming_the_cause(argv, says, capsys):
    with pytest.raises(SystemExit) as info:
        parse_args([*TINY, *argv])
    assert info.value.code == 2
    assert says in capsys.readouterr().err


def test_the_phases_are_marked_in_the_order_a_step_runs_them():
    args = parse_args([*TINY, "--objectives", "dflash", "--lengths", "64"])
    cfg = case_config(args, "tiny", "dflash", 64)
    cfg.drafter.micro_block_tokens = 4 * 16  # two passes of 4 anchors over the one sample
    cfg.drafter.recompute = "off"
    rep, tc = build("tiny", "dflash", cfg, torch.device("cpu"))
    from drafter_step import batch_of
    batch = prepare_batch(batch_of(1, 64, tc.vocab_size), 8, rep.drafter.label_width, seed=0)
    feats = torch.randn(1, 64, rep.drafter.feature_vectors * tc.hidden_size)
    marks = PhasePeaks(rep, torch.device("cpu"))
    rep.accumulate(batch, feats, seed=0)
    marks.switch("optimizer")
    pass_ = ["forward", "loss", "loss backward", "backward"]
    assert marks.seen == ["setup", *pass_, *pass_]  # each closed by the next; the last by us
    assert marks.phase == "optimizer" and set(marks.peaks) == {"setup", *pass_}


def test_a_cpu_run_reports_every_case_and_runs_none_the_plan_refuses(capsys):
    main([*TINY, "--objectives", "dflash", "--lengths", "96", "--warmup", "0"])
    out = capsys.readouterr().out.splitlines()
    (case,) = [json.loads(line) for line in out if line.startswith("{")]
    assert (case["shape"], case["objective"], case["seq_len"], case["layers"]) == (
        "tiny", "dflash", 96, 2)
    assert case["plan_fits"] and case["fitted"] == {} and case["recompute"] is False
    assert set(case["plan_phases_gib"]) == {"forward", "loss", "backward"}
    assert "loss chunk" in case["plan_terms_gib"]["loss"]
    assert case["step_s"] > 0 and case["blocks"] == 8
    assert case["peak_gib"] is None  # no allocator to read on the CPU
    assert out[-1].startswith("| tiny | dflash | 96 | off |")
    # a card too small for anything: reported, not run
    main([*TINY, "--objectives", "dflash", "--lengths", "96", "--gpu-memory-gib", "0.001"])
    (case,) = [json.loads(line) for line in capsys.readouterr().out.splitlines()
               if line.startswith("{")]
    assert not case["plan_fits"] and case["skipped"].startswith("the plan refuses it")
    assert "step_s" not in case


def test_plan_only_says_how_long_a_sample_fits(capsys):
    main(["--plan-only", "--shapes", "27B", "--objectives", "dflash", "--lengths", "131072"])
    case, longest = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    # the seed's drafter at 128k on the 96 GB card: its layers recomputed, and it fits
    assert case["plan_fits"] and case["recompute"] and case["plan_peak_phase"] == "backward"
    assert case["plan_without_recompute_gib"] > 95
    assert longest["longest_sample_drafter_gpu"] >= 131072
    assert longest["longest_sample_with_target_gpu"] <= longest["longest_sample_drafter_gpu"]
