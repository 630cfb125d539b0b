"""The DFlash2 family as the config and the plans see it: its defaults, the keys that never
combine with it, its parameters in the memory plan (the codebooks 2 x V x r: 127M at the 27B
shape), its fused loss's and its layers' terms in the plan, the recipe line."""

import pytest

from dflash_core.config import ConfigError, apply_overrides, config_from_dict, recipe_text
from dflash_core.families.dflash2 import DFLASH2, DFlash2Settings
from dflash_core.families.registry import family_of, settings


def test_defaults_are_the_public_trainers_and_an_objective_set_later_gets_them():
    cfg = config_from_dict({"drafter": {"objective": "dflash2"}})
    assert family_of(cfg) is DFLASH2 and cfg.drafter.block_size == 8
    assert settings(cfg) == DFlash2Settings()
    later = apply_overrides(config_from_dict({"drafter": {"objective": "dflash"}}),
                            [("drafter.objective", "dflash2")])
    assert later.drafter.block_size == 8
    assert config_from_dict({"drafter": {"objective": "dflash2", "block_size": 16}}
                            ).drafter.block_size == 16


@pytest.mark.parametrize("over, key, says", [
    ({"loss": "dpace"}, "drafter.loss", "dpace does not combine with drafter.objective dflash2"),
    ({"selector_missing": "keep"}, "drafter.selector_missing", "keep"),
])
def test_what_never_combines_is_refused_naming_the_key(over, key, says):
    with pytest.raises(ConfigError) as exc:
        config_from_dict({"drafter": {"objective": "dflash2", **over}})
    assert exc.value.key == key and says in str(exc.value)


def test_the_memory_plan_counts_the_codebooks_and_the_convolutions():
    cfg = config_from_dict({"drafter": {"objective": "dflash2", "num_layers": 5}})
    H, V = 5120, 248320
    n = DFLASH2.head_params(cfg.drafter, H, V)
    codebooks = 2 * V * 256
    assert codebooks == pytest.approx(127e6, rel=0.01)
    conv = 5 * 2 * (2 * 2 * H + 2 * 2 * (H // 16) * H)  # two convs a layer: [2,T,H] + [2TM,H]
    assert n == codebooks + 256 * H + conv
    assert DFLASH2.problems(cfg.drafter, vocab=10)[0].key == "drafter.selector_top_k"


def test_recipe_says_the_objective():
    text = recipe_text(config_from_dict({"drafter": {"objective": "dflash2"}}).to_dict())
    assert text.startswith("objective dflash2 (B 8, conv 2 taps x groups of 16, selector rank "
                           "256 top-16, loss DFlash + 1.0 x selector CE")


def test_fused_loss_on_is_accepted_and_the_plan_counts_the_fused_rows():
    cfg = config_from_dict({"drafter": {"objective": "dflash2", "fused_loss": "on"}})
    assert DFLASH2.refusals(cfg.drafter) == []
    V, Hd, chunk, rows = 248320, 5120, 4096, 65536
    fused = DFLASH2.fused_loss_bytes(cfg.drafter, chunk, rows, Hd, V, 2)
    logits = chunk * V * 2  # the one bf16 buffer
    grads = rows * Hd * 4 + 2 * V * 256 * 4  # the rows' states, both codebooks (float32)
    assert logits + grads < fused < logits + grads + chunk * 128 * 1024  # + small per-row parts
    assert fused < 0.5 * chunk * V * DFLASH2.loss_bytes_per_logit  # the torch path's chunk


def test_the_log_says_a_cuda_drafter_runs_the_fused_loss(monkeypatch):
    from dflash_core.models.fused_loss import select
    from dflash_core.planning.drafter_checks import fused_loss_line

    monkeypatch.setattr(select, "triton_installed", lambda: True)
    line = fused_loss_line(config_from_dict({"drafter": {"objective": "dflash2"}}))
    assert line.startswith("drafter loss: fused") and "auto" in line


def test_the_plan_holds_more_per_layer_for_the_convolutions():
    from dflash_core.planning.drafter_memory import (
        UNIT_BYTES, drafter_pass, model_shape, phase_components,
    )

    hf = {"model_type": "qwen3", "hidden_size": 256, "intermediate_size": 512, "vocab_size": 1000,
          "num_hidden_layers": 8, "num_attention_heads": 4, "num_key_value_heads": 2,
          "head_dim": 64}
    s = model_shape(hf)
    base = {"data": {"max_length": 512}, "target": {"layer_ids": [1, 3, 5]}}
    flash = config_from_dict({**base, "drafter": {"objective": "dflash", "block_size": 8}})
    two = config_from_dict({**base, "drafter": {"objective": "dflash2", "block_size": 8}})
    a = phase_components(flash, s, recompute=False)["forward"]["block activations"]
    b = phase_components(two, s, recompute=False)["forward"]["block activations"]
    Q, L = drafter_pass(two).block_tokens, two.drafter.num_layers
    assert b - a == Q * L * DFLASH2.layer_saved_h(two.drafter) * 256 * UNIT_BYTES > 0
    assert DFLASH2.layer_saved_h(two.drafter) == 1.5  # T 2, G 16
