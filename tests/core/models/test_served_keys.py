"""models/served_keys.py: a folder's keys read as vLLM reads them. A causal folder is decoded
causally (the drafter a causal config builds, never the bidirectional one); what this engine
cannot compute is refused in one line naming the key; what its writers state reads back."""

import json

import pytest
import torch

from dflash_core.models import served_keys as sk
from dflash_core.models.dflash.drafter import DFlashDrafter
from dflash_core.models.dflash2.drafter import DFlash2Drafter
from dflash_core.models.dflash2.format import NotDFlash2
from tests.core.models.dflash2.tiny import H, LAYER_IDS, dflash, dflash2

S, A = 11, 2  # context length, blocks per forward


def _inputs(m, seed=0):
    g = torch.Generator().manual_seed(seed)
    B = m.block_size
    ctx = torch.randn(1, S, len(LAYER_IDS) * H, generator=g)
    emb = torch.randn(1, A * B, H, generator=g)
    anchors = torch.tensor([[4, 9]])
    pos = (anchors[0][:, None] + torch.arange(B)).reshape(1, -1)
    return ctx, emb, pos, anchors


def _states(m, emb_change=None, seed=0):
    ctx, emb, pos, anchors = _inputs(m, seed)
    if emb_change is not None:
        emb = emb_change(emb.clone())
    with torch.no_grad():
        return m(ctx, emb, pos, anchors)


def _later_slots_changed(emb, B, j):
    """Every block's inputs from position j on redrawn."""
    view = emb.view(1, A, B, H)
    view[:, :, j:] = torch.randn_like(view[:, :, j:]) * 3
    return emb


def _folder(tmp_path, m, change):
    m.save(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    change(cfg)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return tmp_path


@pytest.mark.parametrize("make", [lambda: dflash(seed=1), lambda: dflash2(seed=1, std=0.2)],
                         ids=["dflash", "dflash2"])
def test_an_is_causal_folder_is_decoded_causally(tmp_path, make):
    """vLLM gives a folder saying is_causal: true causal block attention (each position sees the
    block up to itself). Read here, its block states are the causal drafter's: a position's
    state does not move when later positions' inputs do; the bidirectional reading of the same
    weights (what was decoded before) moves."""
    m = make()
    cls = type(m)
    causal = cls.load(_folder(tmp_path, m, lambda c: c.update(is_causal=True)))
    assert causal.causal and not m.causal
    B, j = m.block_size, 3
    base, moved = _states(causal), _states(causal, lambda e: _later_slots_changed(e, B, j))
    early = (torch.arange(A * B) % B) < j
    assert torch.allclose(base[:, early], moved[:, early], atol=1e-6)
    assert not torch.allclose(base[:, ~early], moved[:, ~early], atol=1e-3)
    bidir = _states(m), _states(m, lambda e: _later_slots_changed(e, B, j))
    assert not torch.allclose(bidir[0][:, early], bidir[1][:, early], atol=1e-3)
    # the drafter a causal config builds, from the same weights: the same states
    cfg = cls.config_from_dict(m.interchange_config())
    cfg.dflash_config = {**cfg.dflash_config, "causal": True}
    built = cls(cfg).eval()
    built.load_state_dict(m.state_dict())
    assert torch.equal(_states(built), base)
    assert not torch.allclose(_states(m), base, atol=1e-3)


def test_vllms_precedence_is_causal_then_dflash_config_causal():
    d = dflash(seed=0).interchange_config()
    del d["is_causal"]
    for top, inner, want in ((None, True, True), (False, True, False), (True, False, True),
                             (None, None, False)):
        c = json.loads(json.dumps(d))
        c["dflash_config"].pop("causal", None)
        if top is not None:
            c["is_causal"] = top
        if inner is not None:
            c["dflash_config"]["causal"] = inner
        assert DFlashDrafter(DFlashDrafter.config_from_dict(c)).causal is want, (top, inner)


def test_a_causal_drafter_states_it_and_reads_back_causal(tmp_path):
    m = dflash2(seed=3)
    m.config.dflash_config = {**m.config.dflash_config, "causal": True}
    m.save(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["is_causal"] is True and cfg["dflash_config"]["causal"] is True
    assert DFlash2Drafter.load(tmp_path).causal


def test_eagle_layer_ids_are_the_ones_read_one_past_ours():
    d = dflash(seed=0).interchange_config()
    assert sk.read(d, "dflash")[1].target_layer_ids == LAYER_IDS
    same = dict(d, eagle_aux_hidden_state_layer_ids=[i + 1 for i in LAYER_IDS])
    assert sk.read(same, "dflash")[1].target_layer_ids == LAYER_IDS
    other = dict(d, eagle_aux_hidden_state_layer_ids=[3, 5, 7])  # vLLM reads these first
    cfg = DFlashDrafter.config_from_dict(other)
    assert cfg.dflash_config["target_layer_ids"] == [2, 4, 6]
    with pytest.raises(sk.ServedKeyRefused, match="id 0 is the target's embedding output"):
        sk.read(dict(d, eagle_aux_hidden_state_layer_ids=[0, 2]), "dflash")


def test_a_top_level_mask_token_id_is_read_for_dflash2():
    m = dflash2(seed=0)
    d = m.interchange_config()
    d["mask_token_id"] = d["dflash_config"].pop("mask_token_id")
    assert DFlash2Drafter(DFlash2Drafter.config_from_dict(d)).mask_token_id == m.mask_token_id


def _refused(d, family, key_text):
    with pytest.raises(sk.ServedKeyRefused) as exc:
        sk.read(d, family)
    said = str(exc.value)
    assert key_text in said and "\n" not in said and "this engine" in said
    return said


@pytest.mark.parametrize("change, says", [
    (lambda c: c["dflash_config"].update(use_swa=True, swa_window_size=2048),
     "dflash_config.use_swa true: vLLM gives every layer a sliding window (of 2048)"),
    (lambda c: c.update(layer_types=["full_attention", "sliding_attention"]),
     "drafter layers of type sliding_attention"),
    (lambda c: c["dflash_config"].update(attention_sink_bias=True),
     "dflash_config.attention_sink_bias true"),
    # the top-level key of other drafters, read when dflash_config names none
    (lambda c: (c["dflash_config"].pop("attention_sink_bias"),
                c.update(add_swa_attention_sink_bias=True)), "add_swa_attention_sink_bias true"),
    (lambda c: c.update(is_neox_style=False), "is_neox_style false"),
    (lambda c: c.update(is_causal="true"), 'is_causal "true": must be true or false'),
    (lambda c: c.update(logit_scale=0.5), "logit_scale 0.5"),
    (lambda c: c.update(draft_vocab_size=100), "draft_vocab_size 100"),
    (lambda c: c["dflash_config"].update(use_aux_hidden_state=False),
     "use_aux_hidden_state false"),
    (lambda c: c["dflash_config"].update(sample_from_anchor=True),
     "dflash_config.sample_from_anchor true"),
    (lambda c: c.update(attention_bias=True), "attention_bias true"),
])
def test_what_this_engine_cannot_compute_is_refused_naming_the_key(change, says):
    d = dflash(seed=0).interchange_config()
    change(d)
    _refused(d, "dflash", says)


def test_a_window_size_without_a_sliding_layer_changes_nothing():
    d = dflash(seed=0).interchange_config()
    d["dflash_config"]["swa_window_size"] = 2048  # vLLM reads it only for sliding layers
    assert sk.read(d, "dflash")[1].causal is False


def test_dflash2_refuses_through_its_own_error():
    d = dflash2(seed=0).interchange_config()
    d["is_neox_style"] = False
    with pytest.raises(NotDFlash2, match="is_neox_style false"):
        DFlash2Drafter.config_from_dict(d)


def test_what_the_writers_state_is_what_a_reader_needs():
    for family, top, inner in (("dflash", {"is_causal", "is_neox_style"},
                                {"causal", "use_swa", "attention_sink_bias"}),
                               ("dspark", {"is_causal", "is_neox_style", "sample_from_anchor",
                                           "dspark_bonus_anchor",
                                           "add_swa_attention_sink_bias"}, set())):
        got = sk.stated(family, False)
        assert (set(got[0]), set(got[1])) == (top, inner)
    d = dflash(seed=0).interchange_config()
    assert sk.unstated(d, "dflash") == {}
    for k in ("is_causal", "is_neox_style"):
        del d[k]
    del d["dflash_config"]["use_swa"]
    assert sk.unstated(d, "dflash") == {"is_causal": False, "is_neox_style": True,
                                        "dflash_config.use_swa": False}


def test_a_mask_embedding_file_is_refused(tmp_path):
    sk.check_files(tmp_path, "dflash")
    (tmp_path / sk.MASK_EMBEDDING).write_bytes(b"")
    with pytest.raises(sk.ServedKeyRefused, match="mask_embedding.pt: vLLM feeds that vector"):
        sk.check_files(tmp_path, "dflash2")
    sk.check_files(tmp_path, "dspark")  # vLLM's DSpark masks through the vocabulary row


def test_a_dspark_folder_says_its_causality_and_feature_layers_at_the_top_level():
    from dflash_core.models.dspark.drafter import DSparkDrafter
    from tests.core.models.dspark.test_dspark_format import make

    d = make().interchange_config()
    assert DSparkDrafter(DSparkDrafter.config_from_dict(d)).causal is False
    d |= {"is_causal": True, "eagle_aux_hidden_state_layer_ids": [2, 4, 6]}
    m = DSparkDrafter(DSparkDrafter.config_from_dict(d))
    assert m.causal and m.target_layer_ids == [1, 3, 5]
    assert json.loads(json.dumps(m.interchange_config()))["is_causal"] is True
