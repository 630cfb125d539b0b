"""A DFlash2 folder given to ``dflash-tui eval``: read as DFlash2 (its selector drafts), checked
against the target like the others (a reduced vocabulary refused in one line), its weights
loaded whole; an incomplete DFlash2 config.json is refused naming the key."""

import json

import pytest
import torch

from dflash_core.eval.drafters import TargetShape, check_against, load_weights, read_drafter
from dflash_core.eval.errors import EvalInputError
from dflash_core.models.dflash2.drafter import DFlash2Drafter
from tests.core.models.dflash2.tiny import H, V, dflash2, head


class Target:
    """What load_weights borrows of a loaded target: its embedding and lm_head."""

    def __init__(self, vocab=V):
        self.embed_tokens, self.lm_head = head(vocab=vocab)


@pytest.fixture
def folder(tmp_path):
    m = dflash2(seed=2, std=0.2)
    m.save(tmp_path / "d2")
    return tmp_path / "d2", m


def test_read_checked_and_loaded_as_dflash2(folder):
    path, m = folder
    spec = read_drafter(str(path))
    assert spec.objective == "dflash2" and spec.block_size == m.block_size
    check_against(spec, TargetShape(H, V, 8))
    with pytest.raises(EvalInputError) as exc:
        check_against(spec, TargetShape(H, V - 4, 8))
    assert "vocabulary 300 (the target's 296)" in str(exc.value) and "\n" not in str(exc.value)
    d = load_weights(spec, Target(), "cpu")
    assert isinstance(d, DFlash2Drafter)
    assert torch.equal(d.candidate_selector.successor_codebook,
                       m.candidate_selector.successor_codebook)


def test_an_incomplete_dflash2_config_is_refused_naming_the_key(folder):
    path, _ = folder
    cfg = json.loads((path / "config.json").read_text())
    del cfg["dflash_config"]["selector_top_k"]
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(EvalInputError, match="lacks dflash_config.selector_top_k"):
        read_drafter(str(path))


def _edit(path, change):
    cfg = json.loads((path / "config.json").read_text())
    change(cfg)
    (path / "config.json").write_text(json.dumps(cfg))


def test_an_is_causal_folder_is_evaluated_causally(folder):
    """vLLM serves a folder saying is_causal: true with causal block attention; eval decodes
    it so too (it read such a folder as bidirectional before: tau 4.44 on a GPU where vLLM's
    reading gives 3.75): its drafts are those of the drafter a causal config builds."""
    from dflash_core.models.proposal import block_states

    path, m = folder
    _edit(path, lambda c: c.update(is_causal=True))
    spec = read_drafter(str(path))
    assert spec.config.dflash_config["causal"] is True
    d = load_weights(spec, Target(), "cpu")
    cfg = DFlash2Drafter.config_from_dict(m.interchange_config())
    cfg.dflash_config = {**cfg.dflash_config, "causal": True}
    built = DFlash2Drafter(cfg).eval()
    built.load_state_dict(m.state_dict())
    built.attach_target_head(*head())
    m.attach_target_head(*head())
    feats = torch.randn(2, 13, 3 * H, generator=torch.Generator().manual_seed(0))
    lengths, last = [13, 9], [5, 77]
    with torch.no_grad():
        got = d.draft_batch(feats, lengths, last).tokens
        assert torch.equal(got, built.draft_batch(feats, lengths, last).tokens)
        states = block_states(d, feats, lengths, last)
        assert torch.allclose(states, block_states(built, feats, lengths, last), atol=1e-5)
        assert not torch.allclose(states, block_states(m, feats, lengths, last), atol=1e-3)


@pytest.mark.parametrize("change, says", [
    (lambda c: c["dflash_config"].update(use_swa=True, swa_window_size=64),
     "dflash_config.use_swa true"),
    (lambda c: c.update(is_neox_style=False), "is_neox_style false"),
])
def test_a_key_eval_cannot_compute_is_one_line_naming_it(folder, change, says):
    path, _ = folder
    _edit(path, change)
    with pytest.raises(EvalInputError) as exc:
        read_drafter(str(path))
    assert says in str(exc.value) and "\n" not in str(exc.value)


def test_a_top_level_mask_token_id_is_read_and_a_mask_embedding_file_refused(folder):
    path, m = folder
    _edit(path, lambda c: c.update(mask_token_id=c["dflash_config"].pop("mask_token_id")))
    spec = read_drafter(str(path))
    assert int(spec.config.dflash_config["mask_token_id"]) == m.mask_token_id
    (path / "mask_embedding.pt").write_bytes(b"")
    with pytest.raises(EvalInputError, match="holds mask_embedding.pt: vLLM feeds that vector"):
        read_drafter(str(path))
