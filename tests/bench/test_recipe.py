"""bench/recipe.py: which runs a sweep makes, and the table that groups them."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from recipe import parse_steps_of, plan_runs, table  # noqa: E402


def test_an_optimizer_can_have_its_own_step_counts_for_an_equal_time_comparison():
    plan = plan_runs([0, 1], ["dflash"], ["adamw", "muon"], 512, parse_steps_of("muon=400,muon=512"))
    assert plan == [("dflash", "adamw", 0, 512), ("dflash", "muon", 0, 400),
                    ("dflash", "muon", 0, 512), ("dflash", "adamw", 1, 512),
                    ("dflash", "muon", 1, 400), ("dflash", "muon", 1, 512)]
    for bad in ("sgd=10", "muon=", "muon=0", "muon=4x"):
        with pytest.raises(ValueError, match="OPTIM=N"):
            parse_steps_of(bad)


def test_the_table_has_a_row_per_loss_optimizer_and_step_count_with_the_seed_spread():
    row = lambda optim, n, seed, tau, cpu: {  # noqa: E731
        "loss": "dflash", "optim": optim, "planned_steps": n, "seed": seed, "tau": tau,
        "cpu_tau": cpu, "ref_tau": None, "tau_tf": 6.0, "train_loss": 0.5, "step_s": 0.04}
    rows = [row("adamw", 512, 1, 5.0, 5.0), row("adamw", 512, 0, 6.0, 6.0),
            row("muon", 400, 0, None, 7.0)]  # an evaluation that failed leaves tau None
    lines = table(rows).splitlines()
    adamw = next(x for x in lines if x.startswith("| dflash | adamw | 512 |"))
    muon = next(x for x in lines if x.startswith("| dflash | muon | 400 |"))
    assert "5.500 ± 0.707 (5.00..6.00)" in adamw and adamw.endswith("| 0,1 |")
    cells = [c.strip() for c in muon.split("|")]
    assert cells[4] == "-" and cells[5].startswith("7.000") and cells[6] == "-"
