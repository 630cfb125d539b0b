"""Position encoding as served (issue 47, item 3): a drafter rotates with its target's rotary
settings, and its config.json says them so that every reader gets the same rotation: a
transformers-5 reader (the public reference, rope_parameters), a reader of the older keys only
(rope_theta + rope_scaling, the YaRN formulas applied here by hand), and this engine."""

from __future__ import annotations

import json
import math

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM
from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

from dflash_core.checkpoint.resume import shape_differences
from dflash_core.config import config_from_dict
from dflash_core.eval.drafter_fields import check_fields
from dflash_core.eval.errors import EvalInputError
from dflash_core.models.dflash.drafter import DFlashDrafter
from dflash_core.models.dspark.drafter import DSparkDrafter, DSparkSettings
from dflash_core.models.registry import new_drafter
from dflash_core.models.rope_settings import RopeConflict, config_rope, drafter_rope
from dflash_core.models.target.config import load_target_config
from dflash_core.models.target.model import TargetModel
from dflash_core.models.training.trainer import build_replicas

from .dflash.test_drafter import reference_dflash  # noqa: F401 - a fixture

V, H, HEAD, THETA = 96, 32, 16, 10_000.0
ORIGINAL, FACTOR = 64, 4.0  # YaRN stretches a 64-position window to 256
YARN = {"rope_type": "yarn", "factor": FACTOR, "original_max_position_embeddings": ORIGINAL}


def yarn_target(folder):
    """A tiny Qwen3 whose config.json asks for YaRN as the hub's model cards say to: the older
    ``rope_theta`` + ``rope_scaling`` keys."""
    cfg = Qwen3Config(vocab_size=V, hidden_size=H, intermediate_size=64, num_hidden_layers=4,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=HEAD,
                      max_position_embeddings=int(ORIGINAL * FACTOR), tie_word_embeddings=False)
    torch.manual_seed(0)
    Qwen3ForCausalLM(cfg).save_pretrained(folder)
    d = json.loads((folder / "config.json").read_text())
    d.pop("rope_parameters", None)
    d.update(rope_theta=THETA, rope_scaling=dict(YARN))
    (folder / "config.json").write_text(json.dumps(d))
    return folder


def trained_drafter(folder):
    """The drafter a run builds against the target (trainer.build_replicas, a fresh one)."""
    cfg = config_from_dict({"drafter": {"objective": "dflash", "num_layers": 1, "block_size": 4},
                            "target": {"layer_ids": [1, 2]}})
    config = load_target_config(folder)
    target = TargetModel(Qwen3ForCausalLM.from_pretrained(folder, config=config))
    (rep,) = build_replicas(cfg.drafter, cfg.optim, target, [torch.device("cpu")], seed=0,
                            layer_ids=[1, 2], mask_id=V - 1)
    return rep.drafter, target


def yarn_by_hand(theta, scaling, head_dim):
    """inv_freq and the cos/sin scale of YaRN (Peng et al. 2023), from rope_theta and
    rope_scaling alone, as a reader of the older keys computes them."""
    factor, original = scaling["factor"], scaling["original_max_position_embeddings"]
    fast, slow = scaling.get("beta_fast", 32), scaling.get("beta_slow", 1)

    def dim_of(rotations):  # the dimension that turns ``rotations`` times over the window
        return head_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = max(math.floor(dim_of(fast)), 0), min(math.ceil(dim_of(slow)), head_dim - 1)
    i = torch.arange(0, head_dim, 2, dtype=torch.float64)
    extrapolated = 1.0 / theta ** (i / head_dim)
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float64) - low) / max(high - low, 1e-3)
            ).clamp(0, 1)
    inv = extrapolated / factor * ramp + extrapolated * (1 - ramp)
    return inv, 0.1 * math.log(factor) + 1.0


def test_a_yarn_target_trains_a_drafter_whose_config_carries_it(tmp_path):
    drafter, target = trained_drafter(yarn_target(tmp_path / "target"))
    cfg = drafter.interchange_config()  # what a checkpoint's config.json holds (run.py)
    assert cfg["rope_parameters"] == {"rope_theta": THETA, **YARN}
    assert cfg["rope_theta"] == THETA and cfg["rope_scaling"] == YARN
    assert cfg["max_position_embeddings"] == ORIGINAL * FACTOR
    # its own layers attend to the whole context, whatever the target's window
    assert cfg["layer_types"] == ["full_attention"] and cfg["sliding_window"] is None
    # and it rotates as the target does, past the original window too
    pos = torch.arange(ORIGINAL * FACTOR)[None]
    x = torch.zeros(1, 1, dtype=torch.float32)
    ours, theirs = drafter.rotary_emb(x, pos), target.model.model.rotary_emb(x, pos)
    assert torch.equal(ours[0], theirs[0]) and torch.equal(ours[1], theirs[1])
    plain = Qwen3RotaryEmbedding(Qwen3Config(head_dim=HEAD, rope_theta=THETA))(x, pos)
    assert not torch.allclose(ours[0], plain[0], atol=1e-3)  # YaRN is not the plain rotation


@pytest.mark.parametrize("ctx_len", [20, 150])  # inside, and past, the original window
def test_the_independent_readers_get_the_same_rotation_and_drafts(tmp_path, reference_dflash,
                                                                   ctx_len):  # noqa: F811
    drafter, _ = trained_drafter(yarn_target(tmp_path / "target"))
    drafter.eval()
    drafter.save(tmp_path / "served")
    d = json.loads((tmp_path / "served" / "config.json").read_text())
    # a reader of the older keys only
    inv, scale = yarn_by_hand(d["rope_theta"], d["rope_scaling"], d["head_dim"])
    assert torch.allclose(drafter.rotary_emb.inv_freq.double(), inv, rtol=1e-6)
    assert drafter.rotary_emb.attention_scaling == pytest.approx(scale)
    # transformers 5 given the older keys alone, and the reference given the folder
    legacy = {k: v for k, v in d.items() if k != "rope_parameters"}
    old = Qwen3RotaryEmbedding(Qwen3Config(**{k: v for k, v in legacy.items()
                                              if k not in ("architectures", "dflash_config")}))
    assert torch.equal(old.inv_freq, drafter.rotary_emb.inv_freq)
    ref = reference_dflash.from_pretrained(str(tmp_path / "served"), dtype=torch.float32).eval()
    assert torch.equal(ref.rotary_emb.inv_freq, drafter.rotary_emb.inv_freq)
    assert ref.rotary_emb.attention_scaling == drafter.rotary_emb.attention_scaling
    # ... and it drafts what this engine drafts
    B = drafter.block_size
    torch.manual_seed(1)
    ctx, emb = torch.randn(1, ctx_len, 2 * H), torch.randn(1, B, H)
    pos = torch.arange(ctx_len + B)[None]
    with torch.no_grad():
        want = ref(position_ids=pos, noise_embedding=emb, target_hidden=ctx)
        got = drafter(ctx, emb, pos[:, ctx_len:], torch.tensor([[ctx_len]]))
    assert (want - got).abs().max().item() <= 1e-4


def test_dspark_writes_and_reads_the_same_settings():
    target = Qwen3Config(vocab_size=V, hidden_size=H, intermediate_size=64, num_hidden_layers=4,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=HEAD,
                         max_position_embeddings=256, rope_parameters={"rope_theta": THETA,
                                                                        **YARN})
    d = new_drafter("dspark", target, num_layers=1, target_layer_ids=[1], block_size=0,
                    mask_token_id=V - 1, settings=DSparkSettings(block_size=3, markov_rank=4))
    cfg = d.interchange_config()
    assert cfg["rope_theta"] == THETA and cfg["rope_scaling"] == YARN
    back = DSparkDrafter(DSparkDrafter.config_from_dict(cfg))
    assert torch.equal(back.rotary_emb.inv_freq, d.rotary_emb.inv_freq)
    assert back.rotary_emb.attention_scaling == d.rotary_emb.attention_scaling != 1.0


def test_what_the_drafter_takes_of_other_targets():
    # settings per layer kind (Gemma 3): the full-attention ones; sections and partial
    # rotation of a multimodal or hybrid target are not the drafter's
    gemma = {"rope_parameters": {"sliding_attention": {"rope_type": "default",
                                                       "rope_theta": 10_000.0},
                                 "full_attention": {"rope_type": "linear", "factor": 8.0,
                                                    "rope_theta": 1_000_000.0}}}
    assert drafter_rope(gemma) == {"rope_type": "linear", "rope_theta": 1e6, "factor": 8.0}
    vl = {"text_config": {"rope_parameters": {"rope_type": "default", "rope_theta": 5e6,
                                              "mrope_section": [24, 20, 20],
                                              "partial_rotary_factor": 0.25}}}
    assert drafter_rope(vl) == {"rope_type": "default", "rope_theta": 5e6}
    # a released drafter's config.json of transformers 4: its theta, not transformers 5's 10000
    old = {"rope_theta": 1_000_000.0, "rope_scaling": None}
    assert config_rope(old) == {"rope_type": "default", "rope_theta": 1e6}
    cfg = DFlashDrafter.config_from_dict({**old, "hidden_size": H, "num_attention_heads": 2,
                                          "head_dim": HEAD, "dflash_config": {}})
    assert cfg.rope_parameters["rope_theta"] == 1e6


def test_a_config_json_whose_two_spellings_differ_is_refused_in_one_line():
    d = DFlashDrafter(DFlashDrafter.config_from_dict({
        "hidden_size": H, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": HEAD,
        "vocab_size": V,
        "intermediate_size": 64, "num_hidden_layers": 1, "max_position_embeddings": 256,
        "rope_parameters": {"rope_theta": THETA, **YARN},
        "dflash_config": {"target_layer_ids": [1], "block_size": 4, "mask_token_id": 0}}))
    cfg = d.interchange_config()
    edited = {**cfg, "rope_scaling": None}  # someone removed the scaling from one spelling
    with pytest.raises(RopeConflict, match="rope_parameters says .*yarn.* rope_theta \\+ "
                                           "rope_scaling say .*default"):
        DFlashDrafter.config_from_dict(edited)
    with pytest.raises(EvalInputError, match="served: config.json's rotary settings: "
                                             "rope_parameters says"):
        check_fields({**edited, **edited["dflash_config"]}, "dflash", "served")
    # a resume of a checkpoint written with the plain rotation, for a YaRN target: named
    plain = {**cfg, "rope_parameters": {"rope_type": "default", "rope_theta": THETA},
             "rope_scaling": None}
    ((key, entry, want, have),) = shape_differences(cfg, plain)
    assert (key, entry) == ("target.path", "rope_parameters")
    assert want["rope_type"] == "yarn" and have == {"rope_type": "default", "rope_theta": THETA}
    assert shape_differences(cfg, json.loads(json.dumps(cfg))) == []


def test_preflight_refuses_an_init_from_folder_whose_two_spellings_differ(tmp_path):
    from dflash_core.config import ConfigError
    from dflash_core.planning.drafter_checks import check_drafter_heads

    folder = tmp_path / "init"
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(b"")
    (folder / "config.json").write_text(json.dumps({
        "rope_parameters": {"rope_theta": THETA, **YARN}, "rope_theta": 5e5,
        "rope_scaling": YARN}))
    cfg = config_from_dict({"drafter": {"init_from": str(folder)}})
    with pytest.raises(ConfigError, match="rotary settings: rope_parameters says .*10000.0.* "
                                          "rope_theta \\+ rope_scaling say .*500000.0") as e:
        check_drafter_heads(cfg, {"num_attention_heads": 2})
    assert e.value.key == "drafter.init_from"
    (folder / "config.json").write_text(json.dumps({"rope_theta": 5e5, "rope_scaling": YARN}))
    # one spelling: nothing to refuse in its rotary settings; the stub is refused next, as the
    # loader would refuse it (no drafter's architectures)
    with pytest.raises(ConfigError, match="not a drafter this engine trains"):
        check_drafter_heads(cfg, {"num_attention_heads": 2})
