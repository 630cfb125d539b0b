"""The served DSpark folder: config.json and model.safetensors as vLLM and SGLang read them,
read back by a loader written here from the format's facts (the public DFlash reference for the
backbone, the heads by hand), which must give this drafter's logits and confidences."""

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from dflash_core.models.dflash.drafter import DFlashDrafter
from dflash_core.models.registry import (
    ObjectiveMismatch,
    drafter_from_config,
    load_drafter,
    new_drafter,
    objective_of,
)
from dflash_core.models.dspark.drafter import DSparkDrafter, DSparkSettings
from dflash_core.models.dspark.format import NotDSpark, config_from_serve_dict

from ..dflash.test_drafter import EXPECTED_KEYS as DFLASH_KEYS
from ..dflash.test_drafter import reference_dflash, tiny_target_config  # noqa: F401 - a fixture

V, H, R, B = 300, 64, 16, 7
SETTINGS = DSparkSettings(block_size=B, markov_rank=R, num_anchors=64)


def make(seed=0, confidence=True):
    settings = SETTINGS if confidence else DSparkSettings(block_size=B, markov_rank=R,
                                                          conf_weight=0.0)
    torch.manual_seed(seed)
    d = new_drafter("dspark", tiny_target_config(), num_layers=2, target_layer_ids=[1, 3, 5],
                    block_size=0, mask_token_id=299, settings=settings).eval()
    d.attach_target_head(torch.nn.Embedding(V, H), torch.nn.Linear(H, V, bias=False))
    with torch.no_grad():  # bf16-exact weights: the bf16 file then holds exactly these values
        for p in list(d.parameters()) + [d.embed_tokens.weight, d.lm_head.weight]:
            p.normal_(0, 0.2)
            p.copy_(p.bfloat16().float())
        d.markov_head.markov_w1.weight.mul_(8)  # a Markov bias that moves the argmax (exact x8)
    return d


def test_config_and_weights_are_the_served_format(tmp_path):
    d = make()
    d.save(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3DSparkModel"] and cfg["model_type"] == "qwen3"
    assert "dflash_config" not in cfg  # every DSpark entry is top-level
    want = {"num_target_layers": 8, "num_hidden_layers": 2, "block_size": B,
            "mask_token_id": 299, "target_layer_ids": [1, 3, 5], "num_anchors": 64,
            "tie_word_embeddings": False, "layer_types": ["full_attention"] * 2,
            "markov_rank": R, "markov_head_type": "vanilla", "enable_confidence_head": True,
            "confidence_head_with_markov": True, "dspark_bonus_anchor": False,
            # anchor-first, in the key vLLM and SGLang read (and the serving keys stated)
            "sample_from_anchor": True, "is_causal": False, "is_neox_style": True,
            "vocab_size": V, "hidden_size": H}
    assert {k: cfg[k] for k in want} == want
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
        dtypes = {f.get_tensor(k).dtype for k in f.keys()}
    assert dtypes == {torch.bfloat16}
    heads = {"embed_tokens.weight": (V, H), "lm_head.weight": (V, H),
             "markov_head.markov_w1.weight": (V, R), "markov_head.markov_w2.weight": (V, R),
             "confidence_head.proj.weight": (1, H + R), "confidence_head.proj.bias": (1,)}
    assert set(shapes) == DFLASH_KEYS | set(heads)
    assert {k: shapes[k] for k in heads} == heads
    # the trained state (resume, optimizer) has the heads but not the frozen copies
    assert set(d.state_dict()) == DFLASH_KEYS | (set(heads) - {"embed_tokens.weight",
                                                                "lm_head.weight"})


def test_without_a_confidence_head_none_is_written(tmp_path):
    make(confidence=False).save(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["enable_confidence_head"] is False
    assert not any(k.startswith("confidence_head") for k in load_file(
        str(tmp_path / "model.safetensors")))


class ServedDSpark:
    """A loader from the format's facts alone: the public DFlash reference builds the backbone
    from the DFlash keys (given a dflash_config made of the top-level entries); the heads are
    applied by hand from their tensors."""

    def __init__(self, folder, reference_cls, scratch):
        cfg = json.loads((folder / "config.json").read_text())
        assert cfg["architectures"] == ["Qwen3DSparkModel"]
        assert not cfg.get("dspark_bonus_anchor", False)  # anchor-as-first
        w = {k: v.float() for k, v in load_file(str(folder / "model.safetensors")).items()}
        self.block, self.mask = cfg["block_size"], cfg["mask_token_id"]
        self.embed, self.lm_head = w.pop("embed_tokens.weight"), w.pop("lm_head.weight")
        self.w1 = w.pop("markov_head.markov_w1.weight")
        self.w2 = w.pop("markov_head.markov_w2.weight")
        self.conf_w = w.pop("confidence_head.proj.weight")
        self.conf_b = w.pop("confidence_head.proj.bias")
        scratch.mkdir()
        ref_cfg = dict(cfg, architectures=["DFlashDraftModel"], dflash_config={
            "target_layer_ids": cfg["target_layer_ids"], "block_size": self.block,
            "mask_token_id": self.mask})
        (scratch / "config.json").write_text(json.dumps(ref_cfg))
        save_file(w, str(scratch / "model.safetensors"))
        self.backbone = reference_cls.from_pretrained(str(scratch), dtype=torch.float32).eval()

    @torch.no_grad()
    def round(self, context, anchor_token):
        """Chain drafting of one round after ``anchor_token`` at position S."""
        S = context.shape[1]
        ids = torch.tensor([[anchor_token] + [self.mask] * (self.block - 1)])
        h = self.backbone(position_ids=torch.arange(S + self.block)[None],
                          noise_embedding=self.embed[ids], target_hidden=context)[0]
        prev, tokens, logits, confs = anchor_token, [], [], []
        for j in range(self.block):
            e = self.w1[prev]
            z = self.lm_head @ h[j] + self.w2 @ e
            confs.append(torch.sigmoid(self.conf_w @ torch.cat([h[j], e]) + self.conf_b))
            prev = int(z.argmax())
            tokens.append(prev)
            logits.append(z)
        return tokens, torch.stack(logits), torch.cat(confs)


@pytest.mark.parametrize("ctx_len", [1, 13, 40])
def test_an_independent_loader_gets_the_same_drafts_logits_and_confidences(
        tmp_path, reference_dflash, ctx_len):  # noqa: F811 - the fixture
    d = make(seed=ctx_len)
    d.save(tmp_path / "served")
    served = ServedDSpark(tmp_path / "served", reference_dflash, tmp_path / "scratch")
    torch.manual_seed(1)
    ctx = torch.randn(1, ctx_len, 3 * H)
    tokens, logits, confs = served.round(ctx, 17)
    ours = d.chain_draft(ctx, 17)
    assert ours.tokens.tolist() == tokens
    torch.testing.assert_close(ours.logits, logits, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(ours.confidences, confs, rtol=1e-4, atol=1e-5)
    assert len(set(tokens)) > 1  # a proposal that varies: the comparison is not trivial


def test_load_round_trip_and_objective_checks(tmp_path):
    d = make()
    d.save(tmp_path / "dspark")
    back = DSparkDrafter.load(tmp_path / "dspark")
    for k, v in d.state_dict().items():
        assert torch.equal(back.state_dict()[k], v), k
    assert objective_of(json.loads((tmp_path / "dspark" / "config.json").read_text())) == "dspark"
    assert isinstance(load_drafter(tmp_path / "dspark", "dspark"), DSparkDrafter)
    # a resume's config rebuilds the same kind; the other kind is refused with the fix
    rebuilt = drafter_from_config(d.interchange_config(), "dspark")
    assert rebuilt.markov_rank == R and rebuilt.block_size == B
    with pytest.raises(ObjectiveMismatch, match="holds a DSpark drafter, but drafter.objective "
                       "is dflash: set drafter.objective: dspark"):
        load_drafter(tmp_path / "dspark", "dflash")
    dflash = DFlashDrafter(DFlashDrafter.config_from_dict(
        {**d.interchange_config(), "architectures": ["DFlashDraftModel"],
         "dflash_config": {"target_layer_ids": [1, 3, 5], "block_size": 8, "mask_token_id": 299}}))
    dflash.save(tmp_path / "dflash")
    with pytest.raises(ObjectiveMismatch, match="holds a DFlash drafter, but drafter.objective "
                       "is dspark"):
        drafter_from_config(dflash.interchange_config(), "dspark", "checkpoint step-3")
    assert type(drafter_from_config(dflash.interchange_config(), "dflash")) is DFlashDrafter


@pytest.mark.parametrize("change,message", [
    ({"architectures": ["DFlashDraftModel"]}, "not a DSpark drafter"),
    ({"markov_head_type": "gated"}, "markov_head_type 'gated'"),
    ({"dspark_bonus_anchor": True}, "this engine's DSpark is anchor-first"),
    # the 1+N (speculators-style) layout in vLLM's and SGLang's key
    ({"sample_from_anchor": False}, "sample_from_anchor false: a 1[+]N block"),
    ({"dspark_draft_topk": 8}, "dspark_draft_topk 8: vLLM applies the Markov head"),
    ({"logit_scale": 2.0}, "logit_scale 2.0"),
    ({"is_neox_style": False}, "is_neox_style false: interleaved"),
    ({"layer_types": ["sliding_attention"] * 2}, "sliding_attention"),
    ({"add_swa_attention_sink_bias": True}, "add_swa_attention_sink_bias true"),
])
def test_configs_this_engine_cannot_serve_are_named(change, message):
    cfg = make().interchange_config()
    with pytest.raises(NotDSpark, match=message):
        config_from_serve_dict({**cfg, **change})


@pytest.mark.parametrize("settings,key", [
    (DSparkSettings(markov_rank=0), "drafter.markov_rank 0"),
    (DSparkSettings(markov_rank=400), "drafter.markov_rank 400 .* exceeds"),
    (DSparkSettings(block_size=0), "drafter.block_size 0"),
    (DSparkSettings(gamma=0.0), "drafter.gamma 0.0"),
    (DSparkSettings(ce_weight=0.0, tv_weight=0.0), "loss weights"),
])
def test_settings_that_do_not_fit_name_the_key(settings, key):
    with pytest.raises(ValueError, match=key):
        new_drafter("dspark", tiny_target_config(), num_layers=1, target_layer_ids=[1],
                    block_size=0, mask_token_id=299, settings=settings)
