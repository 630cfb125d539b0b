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
