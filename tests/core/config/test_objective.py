"""drafter.objective: DSpark's keys, the defaults it chooses for the keys a config leaves to it
(B 7, loss chunk 1024; also after --set), and the combinations refused in one line."""

import pytest

from dflash_core.config import ConfigError, apply_overrides, config_from_dict, recipe_text
from dflash_core.families.registry import settings as dspark_settings
from dflash_core.models.dspark.drafter import DSparkSettings


def test_dspark_is_the_default_with_its_reference_sizes_and_dflash_keeps_its_own():
    spark = config_from_dict({})
    assert spark.drafter.objective == "dspark"
    assert (spark.drafter.block_size, spark.drafter.loss_chunk) == (7, 1024)
    assert dspark_settings(spark) == DSparkSettings()  # the reference's released config
    flash = config_from_dict({"drafter": {"objective": "dflash"}})
    assert dspark_settings(flash) is None
    assert (flash.drafter.block_size, flash.drafter.loss_chunk) == (16, 4096)
    kept = config_from_dict({"drafter": {"objective": "dspark", "block_size": 16,
                                         "loss_chunk": 512}})
    assert (kept.drafter.block_size, kept.drafter.loss_chunk) == (16, 512)


def test_set_objective_chooses_the_defaults_the_config_left_open():
    cfg = config_from_dict({"drafter": {"loss_chunk": 2048}})
    spark = apply_overrides(cfg, [("drafter.objective", "dspark")])
    assert (spark.drafter.block_size, spark.drafter.loss_chunk) == (7, 2048)
    back = apply_overrides(spark, [("drafter.objective", "dflash")])
    assert (back.drafter.block_size, back.drafter.loss_chunk) == (16, 2048)
    both = apply_overrides(cfg, [("drafter.objective", "dspark"), ("drafter.block_size", "5")])
    assert both.drafter.block_size == 5


@pytest.mark.parametrize("drafter, key, words", [
    ({"objective": "dspark", "loss": "dpace"}, "drafter.loss", "dpace does not combine"),
    ({"objective": "dspark", "ce_weight": 0, "tv_weight": 0}, "drafter.tv_weight",
     "must be above 0"),
    ({"objective": "eagle"}, "drafter.objective", "eagle"),
    ({"markov_rank": 0}, "drafter.markov_rank", "must be > 0"),
    ({"conf_weight": -1}, "drafter.conf_weight", "must be >= 0"),
])
def test_combinations_that_cannot_work_are_one_line(drafter, key, words):
    with pytest.raises(ConfigError) as exc:
        config_from_dict({"drafter": drafter})
    assert exc.value.key == key and words in str(exc.value) and "\n" not in str(exc.value)


def test_recipe_says_the_objective():
    text = recipe_text(config_from_dict({"drafter": {"objective": "dspark"}}).to_dict())
    assert text.startswith("objective dspark (B 7, Markov rank 256, loss 0.1 CE + 0.9 TV + "
                           "1.0 confidence, gamma 4)")
    assert "loss dflash" not in text
    flash = config_from_dict({"drafter": {"objective": "dflash"}})
    assert "objective" not in recipe_text(flash.to_dict())
