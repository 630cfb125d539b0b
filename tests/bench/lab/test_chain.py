"""The whole lab chain at a micro version of the tiny scale, on the CPU: every stage through the
command line, the stages refusing to run out of order, the train stage stopped and continued,
and the recipe's figures read back. Marked slow (about three minutes on two cores); the fast
tests beside it cover each stage's parts."""

import json

import pytest

from bench.lab_target import EXIT_PARTIAL, main

pytestmark = pytest.mark.slow

MICRO = ["--scale", "tiny", "--set", "train_steps=60", "--set", "conversations=48",
         "--set", "probe_steps=6", "--set", "train_seconds=3", "--set", "set_prompts=4",
         "--set", "eval_new_tokens=16", "--set", "parallel_runs=2"]  # runs side by side


def test_the_chain_runs_in_parts_that_continue_each_other(tmp_path, capsys):
    args = MICRO + ["--dir", str(tmp_path)]
    assert main(args + ["--stage", "target"]) == 0
    assert main(args + ["--stage", "train"]) == 2  # before its data
    assert "run --stage data first" in capsys.readouterr().err
    assert main(args + ["--stage", "data"]) == 0
    prepared = json.loads((tmp_path / "data" / "lab_data.json").read_text())["prepared"]
    assert prepared["counts"]["samples"] > 0
    # a data stage cut after its generation (as a call's time limit cuts it) keeps the
    # conversations and makes the rest again
    data = tmp_path / "data"
    convs = (data / "conversations.jsonl").read_bytes()
    stamp = (data / "conversations.jsonl").stat().st_mtime_ns
    (data / "lab_data.json").unlink()
    (data / ".lab-partial").write_text("")
    (data / "sets" / "code.jsonl").unlink()
    capsys.readouterr()
    assert main(args + ["--stage", "data"]) == 0
    assert "keeping the" in capsys.readouterr().out
    assert (data / "conversations.jsonl").stat().st_mtime_ns == stamp
    assert (data / "conversations.jsonl").read_bytes() == convs
    assert (data / "sets" / "code.jsonl").is_file() and (data / "lab_data.json").is_file()
    assert json.loads((data / "lab_data.json").read_text())["prepared"] == prepared
    # stopped before its first run (the probes are timed first), then continued
    assert main(args + ["--stage", "train", "--stop-after", "0.01"]) == EXIT_PARTIAL
    timed = set(json.loads((tmp_path / "train" / "timing.json").read_text()))
    assert {k.split("-v")[0] for k in timed} == {"dflash", "dspark"}  # keyed with the variant
    assert main(args + ["--stage", "train"]) == 0
    assert main(args + ["--stage", "eval"]) == 0
    # MICRO changes the tiny scale's recipe (train_seconds, probe_steps): its runs are a variant
    (recipe_json,) = tmp_path.glob("recipe-v*.json")
    summary = json.loads(recipe_json.read_text())
    assert set(summary["sets"]) == {"code", "docstrings"}
    for s in summary["sets"].values():
        runs = s["runs"]
        assert sorted((r["objective"], r["seed"]) for r in runs) == [
            ("dflash", 0), ("dflash", 1), ("dspark", 0), ("dspark", 1)]
        for r in runs:
            assert r["mismatches"] == 0 and r["tau"] >= 1.0 and r["speedup"] > 0
            assert len(r["tau_by_context"]) == len(summary["edges"]) - 1
    recipe_md = recipe_json.with_suffix(".md")
    assert "| dflash (16) | 0,1 |" in recipe_md.read_text()
    # everything is cached: the whole chain again builds nothing new
    stamp = (tmp_path / "target" / "lab_target.json").stat().st_mtime_ns
    runs = sorted(p.name for p in (tmp_path / "train" / "runs").iterdir())
    assert main(args + ["--stage", "all"]) == 0
    assert (tmp_path / "target" / "lab_target.json").stat().st_mtime_ns == stamp
    assert sorted(p.name for p in (tmp_path / "train" / "runs").iterdir()) == runs
    # a setting of DSpark's, one at a time: its runs, evaluation and table beside the default's
    recipe = recipe_md.read_text()
    variant = args + ["--set", "run_sets=dspark:drafter.markov_rank=4"]
    assert main(variant + ["--stage", "train"]) == 0
    assert main(variant + ["--stage", "eval"]) == 0
    tagged = sorted(p.name for p in (tmp_path / "train" / "runs").iterdir()
                    if p.is_dir() and p.name not in runs)
    assert [n.split("-b")[0] for n in tagged] == ["dspark", "dspark", "probe-dspark"]
    (table,) = set(tmp_path.glob("recipe-v*.md")) - {recipe_md}
    assert "| dspark (7) | 0,1 |" in table.read_text() and "dflash (16)" not in table.read_text()
    assert "run_sets dspark:drafter.markov_rank=4" in table.read_text()
    assert recipe_md.read_text() == recipe
    # another recipe in the same folder is refused, naming the fix
    assert main(MICRO + ["--dir", str(tmp_path), "--set", "train_steps=61",
                         "--stage", "target"]) == 2
    assert "another --dir" in capsys.readouterr().err
