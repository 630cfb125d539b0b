"""bench/lab/recipe.py and evaluation.py: the runs at equal time, their configs, and the figures
read from dflash-tui eval's results (tau by context length)."""

import pytest

from bench.lab.errors import LabError
from bench.lab.evaluation import context_edges, rounds_by_context, table, tau_by_context
from bench.lab.recipe import BLOCKS, PlannedRun, plan, run_config_dict, write_config
from bench.lab.scales import scale_named

TINY = scale_named("tiny")


def test_each_objective_gets_the_steps_that_fill_the_same_training_time():
    from bench.lab.recipe import variant_tag

    scale = TINY.replace(train_seconds=100.0, seeds=(0, 1))
    tag = variant_tag(scale)  # train_seconds is the tiny scale's 20 otherwise
    times = {"dflash" + tag: {"s_per_step": 0.5}, "dspark" + tag: {"s_per_step": 0.4}}
    runs = plan(scale, times)
    assert [(r.objective, r.block, r.seed, r.steps) for r in runs] == [
        ("dflash", 16, 0, 200), ("dspark", 7, 0, 250), ("dflash", 16, 1, 200),
        ("dspark", 7, 1, 250)]
    assert {r.steps * times[r.objective + tag]["s_per_step"] for r in runs} == {100.0}
    assert runs[1].name == f"dspark-b7-n250-s0{tag}"
    assert PlannedRun("dflash", 16, 0, 12, probe=True).name == "probe-dflash-b16-n12-s0"


def test_the_run_configs_are_valid_and_differ_only_in_the_objective_and_its_block(tmp_path):
    from dflash_core.config import config_from_dict

    cfgs = {o: config_from_dict(run_config_dict(tmp_path, TINY, PlannedRun(o, b, 1, 30), "cpu"))
            for o, b in BLOCKS.items()}
    assert cfgs["dflash"].drafter.block_size == 16 and cfgs["dspark"].drafter.block_size == 7
    assert cfgs["dspark"].drafter.objective == "dspark"
    for cfg in cfgs.values():
        assert cfg.run.max_steps == 30 and cfg.run.seed == 1
        assert cfg.target.path == str(tmp_path / "target")
        assert cfg.data.path == str(tmp_path / "data" / "prepared")
        assert cfg.layout.device == "cpu" and cfg.target.layer_ids == [1, 2, 3]


def test_a_run_folder_of_another_config_is_refused_not_reused(tmp_path):
    run = PlannedRun("dflash", 16, 0, 30)
    path = write_config(tmp_path, TINY, run, "cpu")
    assert write_config(tmp_path, TINY, run, "cpu") == path  # the same config: fine
    (tmp_path / "train" / "runs" / run.name).mkdir(parents=True)
    with pytest.raises(LabError, match="another config"):
        write_config(tmp_path, TINY.replace(drafter_lr=1e-4), run, "cpu")


def test_every_round_counts_at_the_context_length_where_it_began():
    # prompt of 10 tokens: the prefill gives token 11; rounds accept 3, 0, 5 drafts
    assert rounds_by_context(10, [3, 0, 5]) == [(11, 4), (15, 1), (16, 6)]
    edges = (0, 12, 16, 100)
    lines = [{"prompt_tokens": 10, "acceptance": [3, 0, 5]},
             {"prompt_tokens": 30, "acceptance": [1, 1]}]
    # [0,12): the round at 11 gave 4; [12,16): the round at 15 gave 1; [16,100): 6, 2, 2
    assert tau_by_context(lines, edges) == [4.0, 1.0, 10 / 3]
    assert tau_by_context([], edges) == [None, None, None]
    assert context_edges(TINY) == (16, 64, 160, TINY.max_position_embeddings + 1)


def test_the_table_shows_each_objective_over_its_seeds_and_tau_by_context_length():
    run = lambda objective, block, seed, tau, ctx: {  # noqa: E731
        "objective": objective, "block_size": block, "seed": seed, "steps": 40, "train_s": 20.0,
        "tau": tau, "accepted_per_round": tau - 1, "accepted_at_1": 0.5, "speedup": 1.5,
        "mismatches": 0, "tau_by_context": ctx}
    summary = {"edges": [16, 64, 513], "sets": {"code": {
        "prompts": 4, "plain_tokens_per_s": 100.0, "prompt_tokens": [20, 30, 70, 90],
        "runs": [run("dflash", 16, 0, 3.0, [3.0, None]), run("dflash", 16, 1, 4.0, [5.0, 2.0]),
                 run("dspark", 7, 0, 2.5, [2.5, 2.0])]}}}
    record = {"parameters": 1.2e6, "heldout_loss": 4.5, "final_train_loss": 4.2,
              "tokens_trained": 1000, "train_seconds": 9.0, "device": "cpu"}
    text = table(summary, record, TINY)
    assert "| dflash (16) | 0,1 | 40,40 | 20.0 ± 0.0 | 3.50 ± 0.71 | 2.50 ± 0.71 |" in text
    assert "| dspark (7) | 0 | 40 | 20.0 | 2.50 | 1.50 | 50.0% | 1.50x | exact |" in text
    assert "| objective | 16-63 | 64-512 |" in text
    assert "| dflash | 4.00 ± 1.41 | 2.00 |" in text  # a bucket without rounds is left out


def test_runs_go_side_by_side_in_groups_of_the_scales_size():
    from bench.lab.recipe import groups

    times = {"dflash": {"s_per_step": 0.5}, "dspark": {"s_per_step": 0.4}}
    runs = plan(TINY.replace(seeds=(0, 1, 2)), times)
    got = groups(runs, 2)
    # a seed's two objectives share the device; the order (seed-major) is kept
    assert [[r.name for r in g] for g in got] == [[r.name for r in runs[k:k + 2]]
                                                  for k in (0, 2, 4)]
    assert groups(runs, 1) == [[r] for r in runs] and groups(runs, 0) == [[r] for r in runs]


def test_run_sets_change_the_named_objectives_runs_beside_the_default_ones(tmp_path):
    from dflash_core.config import config_from_dict

    from bench.lab.recipe import blocks, run_sets, variant_tag

    times = {"dflash": {"s_per_step": 0.5}, "dspark": {"s_per_step": 0.4}}
    scale = TINY.replace(run_sets=("dspark:drafter.markov_rank=8", "drafter.num_anchors=24",
                                   "dspark:drafter.block_size=5"))
    tag = variant_tag(scale)
    assert tag.startswith("-v") and variant_tag(TINY) == ""
    # any recipe field changed makes a variant too (not the target's or the data's fields)
    assert variant_tag(TINY.replace(train_seconds=40.0)) not in ("", tag)
    assert variant_tag(TINY.replace(train_steps=10, conversations=5)) == ""
    assert variant_tag(scale.replace(run_sets=scale.run_sets[:2])) != tag
    assert blocks(scale) == {"dflash": 16, "dspark": 5}
    # settings of one objective only: its runs only (the other's are the default runs)
    only = TINY.replace(run_sets=("dspark:drafter.markov_rank=8",))
    assert blocks(only) == {"dspark": 7}
    assert [r.objective for r in plan(only, {"dspark" + variant_tag(only): times["dspark"]})] == [
        "dspark", "dspark"]
    assert [rs.value for rs in run_sets(scale)] == [8, 24, 5]  # YAML values
    # the variant's steps come from its own probes, keyed by objective and tag
    runs = plan(scale, {o + tag: t for o, t in times.items()})
    assert [r.name for r in runs[:2]] == [f"dflash-b16-n40-s0{tag}", f"dspark-b5-n50-s0{tag}"]
    cfgs = {r.objective: config_from_dict(run_config_dict(tmp_path, scale, r, "cpu"))
            for r in runs[:2]}
    assert cfgs["dspark"].drafter.markov_rank == 8 and cfgs["dspark"].drafter.block_size == 5
    assert cfgs["dflash"].drafter.markov_rank != 8 and cfgs["dflash"].drafter.block_size == 16
    assert {c.drafter.num_anchors for c in cfgs.values()} == {24}
    assert cfgs["dspark"].run.name.endswith(tag)


@pytest.mark.parametrize("item", ["drafter.markov_rank", "markov_rank=8", "eagle:drafter.x=1",
                                  "drafter.a.b=1"])
def test_a_run_set_of_another_shape_is_refused_with_an_example(item):
    from bench.lab.recipe import run_sets

    with pytest.raises(LabError, match="OBJECTIVE:.SECTION.KEY=VALUE") as exc:
        run_sets(TINY.replace(run_sets=(item,)))
    assert "markov_rank=64" in exc.value.line()


def test_a_run_set_of_an_unknown_key_is_refused_by_the_configs_check(tmp_path):
    from dflash_core.config import ConfigError, config_from_dict

    scale = TINY.replace(run_sets=("drafter.no_such_key=1",))
    with pytest.raises(ConfigError, match="no_such_key"):
        config_from_dict(run_config_dict(tmp_path, scale, PlannedRun("dflash", 16, 0, 3), "cpu"))
