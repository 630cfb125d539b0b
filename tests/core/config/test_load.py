"""Strict config: every mistake names the key path, the bad value and what is allowed."""

from pathlib import Path

import pytest

from dflash_core.config import ConfigError, config_from_dict, default_gamma, load_config

ROOT = Path(__file__).resolve().parents[3]


def test_real_node_config_loads_and_its_plan_fits_eight_96g_gpus():
    import json

    from dflash_core.planning.memory import plan_memory
    from dflash_core.planning.memory_report import format_plan

    cfg = load_config(ROOT / "config.yaml")
    assert cfg.layout.targets == [0, 1] and cfg.layout.drafters == [2, 3, 4, 5, 6, 7]
    assert cfg.data.token_budget == 65536
    hf = json.loads((ROOT / "tests" / "fixtures" / "qwen3_6_27b_config.json").read_text())
    gpus = {f"cuda:{i}": 96 * 2**30 for i in range(8)}
    plan = plan_memory(cfg, hf, free_bytes=gpus, total_bytes=gpus)
    assert len(plan.rows) == 8 and all(r.fits for r in plan.rows), format_plan(plan)


def test_unknown_key_names_path_value_and_choices():
    with pytest.raises(ConfigError) as e:
        config_from_dict({"data": {"token_budgte": 100}})
    msg = str(e.value)
    assert e.value.key == "data.token_budgte"
    assert "100" in msg and "token_budget" in msg and "Did you mean 'token_budget'" in msg


def test_unknown_section():
    with pytest.raises(ConfigError) as e:
        config_from_dict({"optimiser": {}})
    assert e.value.key == "optimiser" and "optim" in str(e.value)


@pytest.mark.parametrize("data,key,fragment", [
    ({"layout": {"device": "tpu"}}, "layout.device", "['auto', 'cuda', 'cpu']"),
    ({"data": {"token_budget": "lots"}}, "data.token_budget", "expected an integer"),
    ({"data": {"token_budget": 0}}, "data.token_budget", "must be > 0"),
    ({"layout": {"targets": [0, "x"]}}, "layout.targets[1]", "expected an integer"),
    ({"layout": {"drafters": []}}, "layout.drafters", "at least one"),
    ({"wandb": {"enabled": "yes"}}, "wandb.enabled", "true or false"),
    ({"data": {"max_length": 9000, "token_budget": 4096}}, "data.max_length", "exceeds"),
    ({"optim": {"betas": [0.9]}}, "optim.betas", "two numbers"),
])
def test_bad_values_are_named(data, key, fragment):
    with pytest.raises(ConfigError) as e:
        config_from_dict(data)
    assert e.value.key == key
    assert fragment in str(e.value)


def test_yaml_errors_and_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("run: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)
    evil = tmp_path / "evil.yaml"
    evil.write_text("run: !!python/object/apply:os.system ['true']\n")
    with pytest.raises(ConfigError):  # safe_load refuses python tags
        load_config(evil)


def test_gamma_defaults_from_the_paper():
    assert (default_gamma(16), default_gamma(10), default_gamma(8)) == (7.0, 5.0, 4.0)


# Every numeric key has a range; a value outside it is refused at load, naming the key path and
# the range (docs/bad-input.md lists them).
@pytest.mark.parametrize("key,bad,range_text", [
    ("optim.grad_clip", -1, "> 0"),
    ("optim.grad_clip", 0, "> 0"),
    ("optim.lr", 0, "in (0, 1]"),
    ("optim.lr", 3.0, "in (0, 1]"),
    ("optim.warmup_frac", 1.0, "in [0, 1)"),
    ("optim.min_lr_frac", -0.1, "in [0, 1]"),
    ("optim.weight_decay", -0.01, "in [0, 1]"),
    ("optim.epochs", 0, "> 0"),
    ("optim.grad_accum", -2, "> 0"),
    ("checkpoint.keep", -1, ">= 0"),
    ("checkpoint.every", -5, ">= 0"),
    ("eval.every", -1, ">= 0"),
    ("eval.max_new_tokens", 0, "> 0"),
    ("eval.prompt_tokens", 0, "> 0"),
    ("data.eval_prompts", -1, ">= 0"),
    ("data.max_length", 1, ">= 2"),
    ("data.prefetch_batches", 0, "> 0"),
    ("layout.hs_queue", 0, "> 0"),
    ("layout.gpu_memory_gib", -1, ">= 0"),
    ("run.max_steps", -3, ">= 0"),
    ("run.log_every_s", -1, ">= 0"),
    ("telemetry.interval_s", 0, "> 0"),
    ("drafter.gamma", -1, ">= 0"),
    ("drafter.mask_token_id", -2, ">= -1"),
    ("drafter.hidden_size", -64, ">= 0"),
    ("target.num_features", 0, "> 0"),
])
def test_every_numeric_key_is_held_to_its_range(key, bad, range_text):
    section, name = key.split(".")
    with pytest.raises(ConfigError) as e:
        config_from_dict({section: {name: bad}})
    assert e.value.key == key
    assert str(e.value).startswith(f"{key}: must be {range_text}, got ")
    assert str(e.value).endswith((repr(bad), repr(float(bad))))
    assert key in e.value.hint and range_text in e.value.hint


@pytest.mark.parametrize("key", ["cost.gpu_hour_price", "optim.lr", "optim.weight_decay"])
@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
def test_a_number_that_is_not_finite_is_refused_before_it_is_written_anywhere(key, bad):
    # cost.gpu_hour_price: .inf passed its range (>= 0) and reached training_state.json as
    # Infinity, which is not JSON.
    section, name = key.split(".")
    with pytest.raises(ConfigError) as e:
        config_from_dict({section: {name: bad}})
    assert e.value.key == key and "expected a finite number" in str(e.value)
    assert key in e.value.hint


def test_set_of_a_key_under_the_wrong_section_names_the_section_that_has_it():
    from dflash_core.config import Config, apply_overrides

    with pytest.raises(ConfigError) as e:
        apply_overrides(Config(), [("run.lr", "0.1")])
    assert "names no config key (did you mean optim.lr?)" in str(e.value)


def test_eval_fraction_is_gone_and_named_as_unknown():
    # It was accepted and never read; now it is refused like any unknown key.
    with pytest.raises(ConfigError) as e:
        config_from_dict({"data": {"eval_fraction": 0.1}})
    assert e.value.key == "data.eval_fraction" and "unknown key" in str(e.value)


@pytest.mark.parametrize("layout,fragment", [
    ({"targets": [-1]}, "device indices must be >= 0"),
    ({"drafters": [0, 0]}, "repeats a device"),
])
def test_bad_device_lists(layout, fragment):
    with pytest.raises(ConfigError) as e:
        config_from_dict({"layout": layout})
    assert fragment in str(e.value)


def test_the_recipe_in_words_names_the_loss_and_optimizer_with_their_rates():
    from dflash_core.config import recipe_text

    cfg = config_from_dict({"drafter": {"objective": "dflash"}})
    assert recipe_text(cfg.to_dict()) == "loss dflash (gamma 7); optimizer adamw (lr 0.0006)"
    cfg.drafter.loss, cfg.optim.name, cfg.optim.muon_lr = "dpace", "muon", 0.02
    said = recipe_text(cfg.to_dict())
    assert said.startswith("loss dpace (alpha 0.5; its loss figures are D-PACE-weighted")
    assert said.endswith("optimizer muon (muon_lr 0.02, AdamW lr 0.0006 on the norms)")


def test_set_overrides_read_each_value_as_yaml_and_check_it_as_config_yaml_would():
    from dflash_core.config import Config, apply_overrides

    base = Config()
    cfg = apply_overrides(base, [("optim.name", "muon"), ("optim.muon_lr", "0.02"),
                                 ("layout.targets", "[0, 1]"), ("wandb.enabled", "true"),
                                 ("run.name", "muon-1")])
    assert (cfg.optim.name, cfg.optim.muon_lr, cfg.layout.targets) == ("muon", 0.02, [0, 1])
    assert cfg.wandb.enabled is True and cfg.run.name == "muon-1"
    assert base.optim.name == "adamw"  # the given config is left as it was
    assert apply_overrides(base, []) is base
    for (key, text), words in {
            ("optim.nam", "muon"): "names no config key (did you mean optim.name?)",
            ("optim", "muon"): "names no config key",
            ("optim.name.x", "muon"): "names no config key",
            ("optim.name", "sgd"): "choose one of",
            ("optim.lr", "-1"): "must be in (0, 1], got -1.0 (from --set)",
            ("optim.lr", "[1"): "not a value"}.items():
        with pytest.raises(ConfigError) as exc:
            apply_overrides(base, [(key, text)])
        assert words in str(exc.value) and exc.value.key.startswith(key.split(".x")[0])
        assert "--set" in exc.value.hint, exc.value.hint
