"""Exact tau with a DSpark drafter: B chain-drafted tokens per round (slot 0 predicts), all
verified; lossless; teacher-forced scoring makes the pass decoding makes; the Markov head fed
the wrong previous token is measurably worse."""

import pytest
import torch
from transformers import Qwen3Config

from dflash_core.models.dspark.drafter import DSparkDrafter, DSparkSettings, build_dspark_config
from dflash_core.eval.evaluate import (
    evaluate_tau,
    hf_target_fn,
    plain_greedy,
    speculative_generate,
    teacher_forced_eval,
)

from tests.core.eval.test_evaluate import LAYERS, VOCAB, tiny_qwen3

B = 5


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


def dspark_drafter(target_config, seed=1, rank=8, block=B, std=0.3):
    cfg = build_dspark_config(target_config, num_layers=1, target_layer_ids=LAYERS,
                              mask_token_id=VOCAB - 1,
                              settings=DSparkSettings(block_size=block, markov_rank=rank))
    torch.manual_seed(seed)
    d = DSparkDrafter(cfg).eval()
    with torch.no_grad():  # larger weights than the init: proposals that vary with the input
        for p in d.parameters():
            p.normal_(0, std)
    return d


@pytest.fixture(scope="module")
def drafter(target):
    d = dspark_drafter(target.config)
    d.attach_target_head(target.get_input_embeddings(), target.get_output_embeddings())
    return d


PROMPTS = [[5, 17, 3], [1], list(range(10, 40))]


def test_lossless_and_b_drafts_per_round(target_fn, drafter):
    for prompt in PROMPTS:
        ref = plain_greedy(target_fn, prompt, 20)
        got = speculative_generate(target_fn, drafter, prompt, 20, LAYERS)
        assert got.tokens == ref
        assert max(got.acceptance) <= B and len(got.confidences) == got.rounds
        # a full round records B confidences, probabilities
        assert len(got.confidences[0]) == B
        assert all(0.0 < c < 1.0 for cs in got.confidences for c in cs)
    ev = evaluate_tau(target_fn, drafter, PROMPTS, 20, LAYERS)
    assert len(ev.acceptance) == B + 1  # 0..B accepted drafts
    assert len(ev.confidences) == len(ev.accepted) == ev.rounds


def test_chain_feeds_each_slot_the_token_drafted_before_it(target_fn, drafter):
    _, feats = target_fn(torch.tensor([PROMPTS[2]]))
    S = len(PROMPTS[2]) - 1
    d = drafter.chain_draft(feats[:, :S], PROMPTS[2][S])
    hidden = drafter(feats[:, :S], drafter.embed_tokens(torch.tensor([[PROMPTS[2][S]] +
                                                                      [VOCAB - 1] * (B - 1)])),
                     torch.arange(S, S + B)[None], torch.tensor([[S]]))[0]
    prev = torch.tensor([PROMPTS[2][S]] + d.tokens[:-1].tolist())
    want = drafter.markov_logits(hidden, prev)
    torch.testing.assert_close(d.logits, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(d.tokens, want.argmax(-1))
    conf = torch.sigmoid(drafter.confidence_logits(hidden, prev))
    torch.testing.assert_close(d.confidences, conf, rtol=1e-6, atol=1e-6)


def _own_text(target_fn, drafter, prompt, rounds):
    """prompt + a first token, then ``rounds`` times the drafter's own full proposal: every
    round of exact decoding on this text would accept all B drafts."""
    ids = list(prompt) + plain_greedy(target_fn, prompt, 1)
    starts = []
    for _ in range(rounds):
        starts.append(len(ids) - 1)
        _, feats = target_fn(torch.tensor([ids]))
        ids += drafter.draft(feats[:, : len(ids) - 1], ids[-1]).tolist()
    return ids, starts


def test_teacher_forced_eval_scores_what_a_round_accepts(target_fn, drafter):
    prompt = PROMPTS[2]
    ids, starts = _own_text(target_fn, drafter, prompt, rounds=3)
    mask = [0] * len(prompt) + [1] * (len(ids) - len(prompt))
    features = lambda x: target_fn(x)[1]  # noqa: E731
    tau, blocks = teacher_forced_eval(features, drafter, [(ids, mask)])
    assert blocks == len(ids) - len(prompt) - 1
    _, feats = target_fn(torch.tensor([ids]))
    rounds = []
    for S in range(len(prompt), len(ids) - 1):
        n = min(B, len(ids) - 1 - S)
        drafted = drafter.draft(feats[:, :S], ids[S], n).tolist()
        k = 0
        while k < n and drafted[k] == ids[S + 1 + k]:
            k += 1
        rounds.append(k + 1)
    assert tau == pytest.approx(sum(rounds) / len(rounds))
    assert all(rounds[S - len(prompt)] == B + 1 for S in starts)
    assert teacher_forced_eval(features, drafter, [(ids, mask)], anchors=[starts]) == (B + 1, 3)


# ------------------------------------------------------------------------------------------------
# A memorised toy: the target is a bigram machine, the drafter's Markov head holds the bigram
# ------------------------------------------------------------------------------------------------

TOY_V, TOY_H = 32, 16


def toy_successor() -> list[int]:
    g = torch.Generator().manual_seed(7)
    perm = torch.randperm(TOY_V, generator=g).tolist()
    return perm[1:] + perm[:1]  # successor along a cycle through every token: no fixed point


class BigramTarget:
    """Greedy next token = succ[token]; features: a fixed random vector per token."""

    def __init__(self):
        self.succ = torch.tensor(toy_successor())
        self.table = torch.randn(TOY_V, 2 * TOY_H, generator=torch.Generator().manual_seed(8))

    def __call__(self, input_ids):
        logits = 10.0 * torch.nn.functional.one_hot(self.succ[input_ids], TOY_V).float()
        return logits, self.table[input_ids]


def toy_drafter():
    tc = Qwen3Config(vocab_size=TOY_V, hidden_size=TOY_H, intermediate_size=32,
                     num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=1,
                     head_dim=8)
    cfg = build_dspark_config(tc, num_layers=1, target_layer_ids=LAYERS, mask_token_id=TOY_V - 1,
                              settings=DSparkSettings(block_size=B, markov_rank=TOY_V))
    torch.manual_seed(0)
    d = DSparkDrafter(cfg).eval()
    succ = toy_successor()
    with torch.no_grad():
        d.norm.weight.zero_()  # the backbone says nothing: the Markov head alone drafts
        d.markov_head.markov_w1.weight.copy_(torch.eye(TOY_V))
        w2 = torch.zeros(TOY_V, TOY_V)
        w2[succ, torch.arange(TOY_V)] = 10.0  # bias(prev) = 10 * onehot(succ[prev])
        d.markov_head.markov_w2.weight.copy_(w2)
    d.attach_target_head(torch.nn.Embedding(TOY_V, TOY_H), torch.nn.Linear(TOY_H, TOY_V,
                                                                          bias=False))
    return d


class Ablated:
    """The toy drafter with its Markov head fed other than the drafted token."""

    def __init__(self, inner, markov_prev):
        self.inner, self.markov_prev = inner, markov_prev
        self.block_size, self.target_layer_ids = inner.block_size, inner.target_layer_ids
        self.anchor_predicts = True

    def parameters(self):
        return self.inner.parameters()

    def draft(self, context, last_token, num_tokens=None):
        return self.inner.chain_draft(context, last_token, num_tokens, self.markov_prev).tokens


def test_a_memorised_drafter_is_accepted_in_full_blocks_and_a_wrong_prev_is_not():
    target, d = BigramTarget(), toy_drafter()
    prompts = [[3], [11, 4], [0, 1, 2]]
    n = 1 + 3 * (B + 1)  # the first token, then three full rounds
    ev = evaluate_tau(target, d, prompts, n, LAYERS)
    assert ev.tau == B + 1 and ev.acceptance == [0] * B + [3 * len(prompts)]
    # slot 0 is a draft: without it a round would gain at most B tokens
    # The Markov head fed the anchor for every slot (not the drafted token): slot 0 only.
    anchor = evaluate_tau(target, Ablated(d, "anchor"), prompts, n, LAYERS)
    assert anchor.tau == pytest.approx(2.0)
    none = evaluate_tau(target, Ablated(d, "none"), prompts, n, LAYERS)
    assert none.tau < 1.5
    for ev_ in (anchor, none):
        assert all(o == plain_greedy(target, p, n) for o, p in zip(ev_.outputs, prompts))


def test_markov_prev_must_be_named():
    with pytest.raises(ValueError, match="markov_prev 'late'"):
        toy_drafter().chain_draft(torch.zeros(1, 2, 2 * TOY_H), 3, markov_prev="late")


# ------------------------------------------------------------------------------------------------
# Probes: each DSpark fault is named on a memorised sample, and a healthy drafter raises none
# ------------------------------------------------------------------------------------------------

def _toy_sample(length=24, start=5):
    succ = toy_successor()
    ids = [start]
    while len(ids) < length:
        ids.append(succ[ids[-1]])
    ids = torch.tensor(ids)
    return ids, BigramTarget()(ids[None])[1]


def _bigram(d, step):
    """The toy drafter's Markov head set to bias(prev) = 10 * onehot(step(prev))."""
    w2 = torch.zeros(TOY_V, TOY_V)
    for v in range(TOY_V):
        w2[step(v), v] = 10.0
    with torch.no_grad():
        d.markov_head.markov_w2.weight.copy_(w2)
    return d


def test_probes_name_each_dspark_fault():
    from dflash_core.models.dspark.drafter import DSparkDrafter
    from dflash_core.models.dspark.probes import probe

    succ = toy_successor()
    ids, feats = _toy_sample()
    anchors = [2, 6, 9, 13]
    healthy = probe(toy_drafter(), feats, ids, anchors)
    assert healthy.accuracy == [1.0] * B and healthy.own_position == [0.0] * B
    assert healthy.prev_late == 0.0 and healthy.prev_anchor == pytest.approx(1 / B)
    assert healthy.chain_differs == 0 and healthy.faults() == []

    off_by_one = probe(_bigram(toy_drafter(), lambda v: v), feats, ids, anchors)
    (fault,) = off_by_one.faults()
    assert fault.startswith("slot 0 is not predicting")

    stale = probe(_bigram(toy_drafter(), lambda v: succ[succ[v]]), feats, ids, anchors)
    assert stale.prev_late == 1.0
    (fault,) = stale.faults()
    assert fault.startswith("the Markov head is fed the wrong previous token")

    d = toy_drafter()
    d.chain_draft = lambda ctx, tok, n=None: DSparkDrafter.chain_draft(d, ctx, tok, n, "anchor")
    (fault,) = probe(d, feats, ids, anchors).faults()
    assert fault.startswith("decoding's chain feeds the Markov head otherwise")
