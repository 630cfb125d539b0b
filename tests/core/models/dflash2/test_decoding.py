"""Decoding with a DFlash2 drafter through the one loop: greedy is lossless whatever the
selector picks, B-1 drafts a round, the drafts are the selector's walk (not the unary argmax);
sampled decoding draws among the K candidates with the proposal zero elsewhere."""

import pytest
import torch

from dflash_core.eval.evaluate import evaluate_tau, hf_target_fn, plain_greedy, speculative_generate
from dflash_core.eval.spec_decode import DecodeSettings, decode_rows
from dflash_core.eval.target_decoding import fn_rows
from dflash_core.families.dflash2 import DFlash2Settings
from dflash_core.models.dflash2.drafter import DFlash2Drafter

from tests.core.eval.test_evaluate import LAYERS, VOCAB, tiny_qwen3

B, K = 5, 4
PROMPTS = [[5, 17, 3], [1], list(range(10, 40))]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def target():
    return tiny_qwen3(4)


@pytest.fixture(scope="module")
def target_fn(target):
    return hf_target_fn(target, LAYERS)


@pytest.fixture(scope="module")
def drafter(target):
    settings = DFlash2Settings(block_size=B, selector_rank=8, selector_top_k=K)
    cfg = DFlash2Drafter.new_config(target.config, num_layers=1, target_layer_ids=LAYERS,
                                    block_size=B, mask_token_id=VOCAB - 1, settings=settings)
    torch.manual_seed(1)
    d = DFlash2Drafter(cfg).eval()
    with torch.no_grad():  # away from the start: a selector that overrules the unary argmax
        for name, p in d.named_parameters():
            if not name.endswith(("base_kernel", "norm.weight")):
                p.normal_(0, 0.3)
        d.candidate_selector.successor_codebook.mul_(20)
    d.attach_target_head(target.get_input_embeddings(), target.get_output_embeddings())
    return d


def test_greedy_is_lossless_with_b_minus_1_drafts(target_fn, drafter):
    for prompt in PROMPTS:
        ref = plain_greedy(target_fn, prompt, 20)
        got = speculative_generate(target_fn, drafter, prompt, 20, LAYERS)
        assert got.tokens == ref
        assert max(got.proposed) == B - 1 and max(got.acceptance) <= B - 1
    ev = evaluate_tau(target_fn, drafter, PROMPTS, 20, LAYERS)
    assert 1.0 <= ev.tau <= B and len(ev.acceptance) == B


def test_rounds_draft_the_selectors_walk(target_fn, drafter):
    _, feats = target_fn(torch.tensor([PROMPTS[2]]))
    S = len(PROMPTS[2]) - 1
    walk = drafter.draft_batch(feats[:, :S], [S], [PROMPTS[2][S]]).tokens[0]
    unary = drafter.draft_batch(feats[:, :S], [S], [PROMPTS[2][S]], path="unary").tokens[0]
    assert not torch.equal(walk, unary)  # the pair term decides here
    got = speculative_generate(target_fn, drafter, PROMPTS[2][:S + 1], 6, LAYERS)
    # the loop's first round drafts after the target's first token: draft that one directly
    first = got.tokens[0]
    _, feats = target_fn(torch.tensor([PROMPTS[2][:S + 1] + [first]]))
    direct = drafter.draft_batch(feats[:, :S + 1], [S + 1], [first]).tokens[0].tolist()
    assert got.drafts[0] == direct


def test_sampled_decoding_proposes_over_the_candidates(target_fn, drafter):
    _, feats = target_fn(torch.tensor([PROMPTS[0], PROMPTS[0]]))
    gens = [torch.Generator().manual_seed(i) for i in range(2)]
    p = drafter.draft_batch(feats[:, :2], [2, 2], [3, 3], temperature=0.7, gens=gens)
    assert p.probs.shape == (2, B - 1, VOCAB)
    assert torch.allclose(p.probs.sum(-1), torch.ones(2, B - 1))
    assert ((p.probs > 0).sum(-1) <= K).all()  # zero mass off the K candidates
    assert (p.probs.gather(-1, p.tokens[..., None]) > 0).all()
    settings = DecodeSettings(12, temperature=0.7)
    rows = decode_rows(fn_rows(target_fn, "cpu"), drafter, PROMPTS[:2], settings,
                       [torch.Generator().manual_seed(i) for i in range(2)])
    assert all(len(r.tokens) == 12 for r in rows)
