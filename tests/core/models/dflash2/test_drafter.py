"""The DFlash2 drafter: a fresh one is a DFlash drafter (the same backbone weights from the same
seed, the same forward, the same drafts); started from a DFlash folder it drafts what that
drafter drafts; a reduced vocabulary is refused in one line."""

import pytest
import torch

from dflash_core.families.dflash2 import DFlash2Settings
from dflash_core.models.dflash2.drafter import DFlash2Drafter
from dflash_core.models.proposal import block_states
from dflash_core.models.registry import load_drafter

from .tiny import B, H, LAYER_IDS, SETTINGS, V, dflash, dflash2, head

FEATS = len(LAYER_IDS) * H


def inputs(seed=0, S=11, A=3):
    g = torch.Generator().manual_seed(seed)
    ctx = torch.randn(1, S + B, FEATS, generator=g)
    anchors = torch.tensor([[2, 5, S]])[:, :A]
    emb = torch.randn(1, A * B, H, generator=g)
    pos = (anchors[0, :, None] + torch.arange(B)).view(1, -1)
    return ctx, emb, pos, anchors


def test_fresh_dflash2_is_the_dflash_drafter_of_the_same_seed():
    one, two = dflash(seed=4), dflash2(seed=4)
    own = two.state_dict()
    shared = one.state_dict()
    assert all(torch.equal(v, own[k]) for k, v in shared.items())
    assert set(own) - set(shared) and all("_conv." in k or k.startswith("candidate_selector.")
                                          for k in set(own) - set(shared))
    ctx, emb, pos, anchors = inputs()
    with torch.no_grad():
        assert torch.equal(one(ctx, emb, pos, anchors), two(ctx, emb, pos, anchors))


def test_fresh_dflash2_drafts_the_unary_argmax():
    """The successor codebook starts at zero: the walk picks each slot's unary argmax, which is
    DFlash's draft."""
    one, two = dflash(seed=2), dflash2(seed=2)
    emb, lm = head()
    for m in (one, two):
        m.attach_target_head(emb, lm)
    ctx = torch.randn(2, 9, FEATS)
    want = one.draft_batch(ctx, [9, 6], [4, 8]).tokens
    assert torch.equal(two.draft_batch(ctx, [9, 6], [4, 8]).tokens, want)
    assert torch.equal(two.draft_batch(ctx, [9, 6], [4, 8], path="unary").tokens, want)


def test_trained_convolutions_change_the_forward_and_stay_inside_blocks():
    """Away from identity, blocks trained in one pass still equal each block drafted alone (the
    convolution never reads another block), and the forward is no longer DFlash's."""
    m = dflash2(seed=1, std=0.2)
    ctx, emb, pos, anchors = inputs(1)
    with torch.no_grad():
        joint = m(ctx, emb, pos, anchors)
        for a, p in enumerate(anchors[0].tolist()):
            alone = m(ctx[:, :p], emb[:, a * B:(a + 1) * B], pos[:, a * B:(a + 1) * B],
                      torch.tensor([[p]]))
            assert torch.allclose(joint[:, a * B:(a + 1) * B], alone, atol=1e-5)
        plain = dflash(seed=1)
        plain.load_state_dict({k: v for k, v in m.state_dict().items()
                               if k in plain.state_dict()})
        assert not torch.allclose(plain(ctx, emb, pos, anchors), joint, atol=1e-3)


def test_init_from_a_dflash_folder_starts_at_that_drafter(tmp_path):
    one = dflash(seed=3, block=8)
    with torch.no_grad():
        for p in one.parameters():
            p.normal_(0, 0.2)
    one.save(tmp_path)
    settings = DFlash2Settings(block_size=B, selector_rank=8, selector_top_k=5)
    two = load_drafter(tmp_path, "dflash2", settings)
    assert isinstance(two, DFlash2Drafter) and two.block_size == B
    assert two.config.dflash_config["selector_rank"] == 8
    emb, lm = head()
    one.attach_target_head(emb, lm)
    two.attach_target_head(emb, lm)
    ctx = torch.randn(1, 12, FEATS)
    one.block_size = B  # the run's block size (a DFlash drafter drafts at any B of its own)
    with torch.no_grad():
        assert torch.equal(block_states(one, ctx, [12], [5]), block_states(two, ctx, [12], [5]))
    assert torch.equal(one.draft_batch(ctx, [12], [5]).tokens, two.draft_batch(ctx, [12], [5]).tokens)


def test_a_reduced_vocabulary_is_refused_in_one_line():
    m = dflash2()
    emb, lm = head(vocab=V - 40)
    with pytest.raises(ValueError) as err:
        m.attach_target_head(emb, lm)
    msg = str(err.value)
    assert "\n" not in msg and "full vocabulary" in msg and f"{V - 40}" in msg
    from dflash_core.models.dflash2.format import NotDFlash2

    served = m.interchange_config() | {"draft_vocab_size": 100}
    with pytest.raises(NotDFlash2, match="full vocabulary"):
        DFlash2Drafter.config_from_dict(served)


def test_settings_that_cannot_work_are_named():
    assert DFlash2Settings(conv_group_size=24).problems(hidden_size=64)[0].startswith(
        "drafter.conv_group_size 24")
    assert DFlash2Settings(selector_top_k=400).problems(vocab_size=300)[0].startswith(
        "drafter.selector_top_k 400")
    assert SETTINGS.problems(V, H) == []


def test_block_choice_is_what_a_round_drafts():
    """check's probes compare the training forward's choice with draft(): both are the walk."""
    m = dflash2(seed=6, std=0.3)
    m.attach_target_head(*head())
    ctx = torch.randn(1, 10, FEATS)
    with torch.no_grad():
        states = block_states(m, ctx, [10], [17])
    assert torch.equal(m.block_choice(states, 17), m.draft(ctx, 17))
    assert not torch.equal(m.block_choice(states, 17), m.block_choice(states, 18))
