"""Each key's default, doc and range live on its field (schema.key): every key has a doc, every
number a range (or says why not), and config.yaml names no key the schema lacks."""

from pathlib import Path

import pytest
import yaml

from dflash_core.config import (RANGES, UNBOUNDED, Config, ConfigError, check_range, config_keys,
                                key_value)

ROOT = Path(__file__).resolve().parents[3]


def test_every_key_has_a_doc_and_every_number_a_range_its_default_is_inside():
    specs = list(config_keys())
    assert len(specs) == len({s.path for s in specs}) > 60
    for spec in specs:
        assert len(spec.doc) > 10 and spec.doc.endswith("."), spec.path
        assert spec.default == key_value(Config(), spec.path), spec.path
        numeric = isinstance(spec.default, (int, float)) and not isinstance(spec.default, bool)
        assert numeric == (spec.range is not None or bool(spec.unbounded)), spec.path
        if spec.range is not None:
            check_range(spec.path, spec.default)  # the defaults are valid
    assert RANGES == {s.path: s.range for s in specs if s.range is not None}
    assert UNBOUNDED == {"run.seed": "any integer"}


def test_the_range_on_the_field_is_the_one_loading_holds_a_value_to():
    spec = next(s for s in config_keys() if s.path == "optim.warmup_frac")
    assert spec.range == (0, 1, True, False)
    with pytest.raises(ConfigError, match=r"optim.warmup_frac: must be in \[0, 1\), got 1.0"):
        check_range("optim.warmup_frac", 1.0)


def test_list_defaults_are_not_shared_between_configs():
    a, b = Config(), Config()
    a.layout.targets.append(5)
    a.wandb.settings["x"] = 1
    assert b.layout.targets == [0] and b.wandb.settings == {}


def test_every_key_of_the_shipped_config_yaml_is_in_the_schema():
    data = yaml.safe_load((ROOT / "config.yaml").read_text())
    known = {s.path for s in config_keys()}
    sections = {p.split(".")[0] for p in known}
    said = [f"{sec}.{name}" for sec, keys in data.items() for name in keys]
    assert set(data) <= sections and said
    assert [p for p in said if p not in known] == []
