"""bench/training/recipe.py: which runs a sweep makes, and the table that groups them."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "bench" / "training"))

from recipe import (  # noqa: E402
    parse_objective_sets, parse_steps_of, plan_runs, plan_sweep, table,
)


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


def test_objectives_are_a_dimension_with_their_own_settings_and_step_counts():
    sets = parse_objective_sets(["dspark:drafter.block_size=7", "dspark:drafter.markov_rank=64"])
    assert sets == {"dspark": [("drafter.block_size", "7"), ("drafter.markov_rank", "64")]}
    for bad in ("dspark=7", "eagle:drafter.block_size=7", "dspark:block_size=7",
                "dspark:drafter.block_size"):
        with pytest.raises(ValueError, match="OBJECTIVE:SECTION.KEY=VALUE"):
            parse_objective_sets([bad])
    # the cheaper objective's runs get the steps that cost the other's --steps; DSpark with
    # D-PACE is left out (the config refuses it)
    plan = plan_sweep([0, 1], ["dflash", "dspark"], ["dflash", "dpace"], ["adamw"], 256,
                      parse_steps_of("dspark=268"))
    assert plan == [("dflash", "dflash", "adamw", 0, 256), ("dflash", "dpace", "adamw", 0, 256),
                    ("dspark", "dflash", "adamw", 0, 268),
                    ("dflash", "dflash", "adamw", 1, 256), ("dflash", "dpace", "adamw", 1, 256),
                    ("dspark", "dflash", "adamw", 1, 268)]
    by_optim = plan_sweep([0], ["dspark"], ["dflash"], ["adamw", "muon"], 80,
                          parse_steps_of("muon=60"))
    assert by_optim == [("dspark", "dflash", "adamw", 0, 80), ("dspark", "dflash", "muon", 0, 60)]
    with pytest.raises(ValueError, match="both optimizers and objectives"):
        parse_steps_of("muon=60,dspark=268")


def test_a_sweep_with_dspark_has_an_objective_column_naming_the_block_size():
    row = lambda objective, b, n, seed, tau: {  # noqa: E731
        "objective": objective, "block_size": b, "loss": "dflash", "optim": "adamw",
        "planned_steps": n, "seed": seed, "tau": tau, "tau_tf": 6.0, "train_loss": 0.5,
        "step_s": 0.4, "wall_s": 120.0}
    lines = table([row("dflash", 8, 256, 0, 5.0), row("dspark", 7, 268, 0, 6.0),
                   row("dspark", 7, 268, 1, 7.0)]).splitlines()
    assert lines[2].startswith("| drafter.objective (B) | drafter.loss |")
    assert lines[3].count("|---") == lines[2].count("|") - 1
    dspark = next(x for x in lines if x.startswith("| dspark (7) | dflash | adamw | 268 |"))
    assert "6.500 ± 0.707 (6.00..7.00)" in dspark and dspark.endswith("| 120.000 | 0,1 |")
    assert any(x.startswith("| dflash (8) | dflash | adamw | 256 | 5.000") for x in lines)
