"""eval.prompt_sets and eval.best_set at config load: each mistake one line naming the item's key
(the files and the chat template are preflight's: tests/core/eval/test_run_sets.py)."""

import pytest
import yaml

from dflash_core.config import ConfigError, apply_overrides, config_from_dict, load_config, \
    save_config


def sets_config(*sets, **eval_keys):
    return config_from_dict({"eval": {"prompt_sets": list(sets), **eval_keys}})


def test_sets_load_with_their_defaults_and_round_trip_through_the_run_folder(tmp_path):
    cfg = sets_config({"name": "gsm8k", "path": "sets/gsm8k.jsonl", "thinking": "off"},
                      {"name": "mt-bench", "path": "mt.jsonl", "prompts": 0,
                       "max_new_tokens": 128}, best_set="gsm8k")
    a, b = cfg.eval.prompt_sets
    assert (a.name, a.path, a.thinking, a.prompts, a.max_new_tokens) == (
        "gsm8k", "sets/gsm8k.jsonl", "off", 16, 0)
    assert (b.thinking, b.prompts, b.max_new_tokens) == ("template", 0, 128)
    save_config(cfg, tmp_path / "config.yaml")  # the run folder's copy reads back the same
    again = load_config(tmp_path / "config.yaml")
    assert again.eval.prompt_sets == cfg.eval.prompt_sets and again.eval.best_set == "gsm8k"
    assert config_from_dict({}).eval.prompt_sets == []  # none by default


def test_set_gives_the_sets_as_yaml():
    cfg = apply_overrides(config_from_dict({}), [
        ("eval.prompt_sets", "[{name: a, path: a.jsonl}, {name: b, path: b.jsonl}]")])
    assert [s.name for s in cfg.eval.prompt_sets] == ["a", "b"]


@pytest.mark.parametrize("sets, best, key, says, hint", [
    ([{"name": "a", "path": "x"}, {"name": "a", "path": "y"}], "", "eval.prompt_sets[1].name",
     "'a' names two sets (items 0 and 1)", "give each set its own name"),
    ([{"path": "x"}], "", "eval.prompt_sets[0].name", "missing", "add name:"),
    ([{"name": "gsm 8k", "path": "x"}], "", "eval.prompt_sets[0].name",
     "use letters, digits", "'gsm-8k'"),
    ([{"name": "a"}], "", "eval.prompt_sets[0].path", "missing: set a needs its JSONL file",
     "add path:"),
    ([{"name": "a", "path": "x", "prompts": -1}], "", "eval.prompt_sets[0].prompts",
     "must be >= 0, got -1", ">= 0"),
    ([{"name": "a", "path": "x", "thinking": "no"}], "", "eval.prompt_sets[0].thinking",
     "'no' is not allowed", "'template', 'on', 'off'"),
    ([{"name": "a", "path": "x", "nmae": "b"}], "", "eval.prompt_sets[0].nmae",
     "Did you mean 'name'?", "remove or rename"),
    (["gsm8k=x.jsonl"], "", "eval.prompt_sets[0]", "expected a mapping", "name: value"),
    ([{"name": "a", "path": "x"}], "b", "eval.best_set", "'b' names no set of "
     "eval.prompt_sets (a)", '"" (the held-out tau)'),
])
def test_a_bad_set_is_one_line_naming_its_key(sets, best, key, says, hint):
    with pytest.raises(ConfigError) as exc:
        sets_config(*sets, best_set=best)
    assert exc.value.key == key and says in str(exc.value) and "\n" not in str(exc.value)
    assert hint in exc.value.hint


def test_config_yaml_shows_the_sets_commented_and_loads_with_none():
    from tests.core.config.test_load import ROOT

    text = (ROOT / "config.yaml").read_text()
    assert "prompt_sets:" in text and "best_set" in text
    assert yaml.safe_load(text)["eval"].get("prompt_sets") in (None, [])
