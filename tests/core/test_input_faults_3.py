"""Bad-input sweep, round three: config files of the wrong shape (docs/bad-input.md). Each is
refused at load, before any run folder or model, with the key, the cause and a hint."""

import pytest
import yaml

from dflash_core.config import ConfigError, load_config

from .engine_fixtures import make_config



def valid(tmp_path) -> dict:
    return make_config(tmp_path, tmp_path / "target", tmp_path / "data").to_dict()


def set_in(section: str, key: str, value):
    def edit(d: dict) -> str:
        d[section][key] = value
        return yaml.safe_dump(d, sort_keys=False)
    return edit


# name: (text, or a function of a valid config dict giving the text; the words the error names)
CASES = {
    "empty file": ("", ["is empty", "--demo"]),
    "only a comment": ("# to do\n", ["is empty"]),
    "a list at top level": ("- run\n- data\n", ["mapping at top level", "list", "sections"]),
    "a number at top level": ("42\n", ["mapping at top level", "int"]),
    "a key set twice": ("data:\n  token_budget: 256\n  token_budget: 512\n",
                        ["data.token_budget", "set twice", "lines 2 and 3", "keep one"]),
    "a section set twice": ("run:\n  name: a\nrun:\n  name: b\n", ["run: set twice"]),
    "a list where a number goes": (set_in("data", "token_budget", [256]),
                                   ["data.token_budget", "expected an integer", "a whole number"]),
    "a string for a bool": (set_in("data", "balance_steps", "yes"),
                            ["data.balance_steps", "true or false"]),
    "nested where flat": (set_in("optim", "lr", {"value": 1e-4}),
                          ["optim.lr", "expected a number"]),
    "an empty section": ("data:\n", ["data: expected a mapping", "section"]),
    "a section that is a list": ("data:\n  - 1\n", ["data: expected a mapping"]),
    "a flat key at top level": ("token_budget: 256\n", ["token_budget: unknown key"]),
    "a fraction where a whole number goes": (set_in("data", "token_budget", 256.5),
                                             ["data.token_budget", "expected an integer"]),
    "an infinite learning rate": (set_in("optim", "lr", float("inf")),
                                  ["optim.lr", "expected a finite number"]),
    "layer ids a number": (set_in("target", "layer_ids", 3),
                           ["target.layer_ids", "expected a list"]),
    "a layer id a string": (set_in("target", "layer_ids", [1, "x"]),
                            ["target.layer_ids[1]", "expected an integer"]),
    "three betas": (set_in("optim", "betas", [0.9, 0.9, 0.9]), ["optim.betas", "two numbers"]),
    "run name null": (set_in("run", "name", None), ["run.name", "expected a string"]),
}


@pytest.mark.parametrize("name", list(CASES))
def test_a_badly_shaped_config_is_refused_with_its_cause_and_a_hint(tmp_path, name):
    text, words = CASES[name]
    path = tmp_path / "config.yaml"
    path.write_text(text if isinstance(text, str) else text(valid(tmp_path)), encoding="utf-8")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    said = f"{info.value} | {info.value.hint}"
    for word in words:
        assert word in said, said
    assert info.value.hint, f"no hint: {said}"
    assert not (tmp_path / "runs").exists()  # nothing made


def test_a_run_folder_under_a_file_is_a_config_error_not_a_crash_of_the_inbox(tmp_path):
    # run.output_dir under a file: the command inbox started before preflight once raised
    # NotADirectoryError (a traceback, exit 1); preflight names run.output_dir (exit 2).
    from dflash_core.pipeline.inbox import CommandInbox

    (tmp_path / "afile").write_text("x")
    said = []
    inbox = CommandInbox(None, tmp_path / "afile" / "runs" / "t", said.append, poll_s=0.01)
    inbox.start()
    try:
        assert inbox.poll_once() == []
    finally:
        inbox.close()
    assert (tmp_path / "afile").read_text() == "x"  # nothing lost


def test_a_loss_mask_of_zeros_everywhere_is_refused_before_any_model_loads(tmp_path):
    from dflash_core.data import ShardedDataset, write_shards
    from dflash_core.planning.data_checks import check_something_trains

    ids = list(range(1, 40))
    write_shards([{"input_ids": ids, "loss_mask": [0] * 39}] * 8, tmp_path / "zero")
    with pytest.raises(ConfigError) as info:
        check_something_trains(ShardedDataset.open(tmp_path / "zero"), tmp_path / "zero")
    assert "loss mask is 0 in every sample" in str(info.value) and "data prepare" in info.value.hint
    # one trained token past the first is enough
    write_shards([{"input_ids": ids, "loss_mask": [0] * 38 + [1]}] + [
        {"input_ids": ids, "loss_mask": [0] * 39}] * 7, tmp_path / "one")
    check_something_trains(ShardedDataset.open(tmp_path / "one"), tmp_path / "one")


def test_a_cpu_run_whose_plan_exceeds_host_memory_is_refused_with_the_numbers(tmp_path):
    import json
    from pathlib import Path

    import psutil
    import torch

    from dflash_core.planning.capacity_checks import check_memory

    hf = json.loads((Path(__file__).parents[1] / "fixtures" / "qwen3_8b_config.json").read_text())
    cfg = make_config(tmp_path, tmp_path / "t", tmp_path / "d", layout__device="cpu",
                      data__token_budget=1 << 30, data__max_seqs_per_batch=1 << 16,
                      target__num_features=5)
    cpu = [torch.device("cpu")]
    with pytest.raises(ConfigError) as info:
        check_memory(cfg, hf, cpu, cpu, publish=lambda e: None)
    said = str(info.value)
    assert "does not fit" in said and "cpu" in said
    free_gib = psutil.virtual_memory().available / 2**30
    assert free_gib < 10**6  # the plan's numbers are in GiB against this machine's free memory
