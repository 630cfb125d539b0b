"""Batched speculative decoding: what one prompt alone gives (the engine's exact decoding), for
DFlash and DSpark, with full forwards and with the cache (attention-only and hybrid targets);
greedy output equals the target's own; sampling is seeded."""

import pytest
import torch

from dflash_core.context_buckets import Buckets, by_context, round_positions
from dflash_core.eval import drafting, spec_decode
from dflash_core.eval.drafters import load_weights, read_drafter
from dflash_core.eval.sampling import prompt_generator
from dflash_core.eval.spec_decode import DecodeSettings, decode_rows
from dflash_core.eval.target_decoding import CachedRows, FullBatch, head_is_lm_head
from dflash_core.eval.evaluate import evaluate_tau, plain_greedy, target_fn_for
from dflash_core.models.target.load import load_target
from tests.core.eval.conftest import DEMO_LAYERS, chat_target, save_dflash, save_dspark

NEW = 24
PROMPTS = [list(b"The value of "), list(b"x"), list(b"Built-in functions and the return ")]


@pytest.fixture(scope="module")
def demo(demo_target):
    return load_target(demo_target, dtype="float32")


@pytest.fixture(scope="module")
def drafters(demo, demo_hf_config, tmp_path_factory, module_thread):
    root = tmp_path_factory.mktemp("drafters")
    out = {}
    for name, save in (("dflash", save_dflash), ("dspark", save_dspark)):
        spec = read_drafter(str(save(root / name, demo_hf_config, 3)))
        out[name] = load_weights(spec, demo, "cpu")
        out[name].attn_impl = "chunked"
    return out


@pytest.mark.parametrize("kind", ["dflash", "dspark"])
def test_batched_proposals_are_what_each_prompt_alone_gets(demo, drafters, kind):
    d = drafters[kind]
    feats = [demo.features(torch.tensor([p]), layer_ids=DEMO_LAYERS) for p in PROMPTS]
    lengths = [len(p) - 1 for p in PROMPTS]  # the last token is the anchor
    ctx = torch.zeros(len(PROMPTS), max(lengths), feats[0].shape[-1])
    for i, (f, S) in enumerate(zip(feats, lengths)):
        ctx[i, :S] = f[0, :S]
    prop = drafting.propose(d, ctx, lengths, [p[-1] for p in PROMPTS])
    for i, (f, S) in enumerate(zip(feats, lengths)):
        alone = d.draft(f[:, :S], PROMPTS[i][-1])
        assert prop.tokens[i].tolist() == alone.tolist()


@pytest.mark.parametrize("kind", ["dflash", "dspark"])
@pytest.mark.parametrize("exact_head", [True, False], ids=["lm-head", "model-logits"])
def test_a_batch_decodes_as_the_engine_decodes_each_prompt(demo, drafters, kind, exact_head):
    d = drafters[kind]
    rows = decode_rows(FullBatch(demo, DEMO_LAYERS, exact_head), d, PROMPTS,
                       DecodeSettings(NEW))
    want = evaluate_tau(target_fn_for(demo, DEMO_LAYERS), d, PROMPTS, NEW, DEMO_LAYERS)
    fn = target_fn_for(demo, DEMO_LAYERS)
    for r, out, p in zip(rows, want.outputs, PROMPTS):
        assert r.tokens == out == plain_greedy(fn, p, NEW)  # lossless
    hist = [0] * len(want.acceptance)
    for r in rows:
        for a in r.acceptance:
            hist[a] += 1
    assert hist == want.acceptance
    assert all(p <= d.block_size for r in rows for p in r.proposed)


@pytest.mark.parametrize("cache", [False, True], ids=["full", "cache"])
def test_a_batch_records_dsparks_confidences_as_the_engine_does(demo, drafters, cache):
    # the run's evaluation of a prompt set calibrates DSpark's confidence head on them
    d = drafters["dspark"]
    assert d.confidence_head is not None
    backend = CachedRows(demo, DEMO_LAYERS) if cache else FullBatch(demo, DEMO_LAYERS)
    rows = decode_rows(backend, d, PROMPTS, DecodeSettings(NEW))
    want = evaluate_tau(target_fn_for(demo, DEMO_LAYERS), d, PROMPTS, NEW, DEMO_LAYERS)
    got = [c for r in rows for c in r.confidences]
    assert [len(c) for c in got] == [len(c) for c in want.confidences]
    assert torch.allclose(torch.tensor([x for c in got for x in c]),
                          torch.tensor([x for c in want.confidences for x in c]), atol=1e-5)
    assert [a for r in rows for a in r.acceptance] == want.accepted
    assert all(r.confidences == [] for r in decode_rows(
        FullBatch(demo, DEMO_LAYERS), drafters["dflash"], PROMPTS, DecodeSettings(NEW)))


def test_the_demo_target_head_is_its_lm_head(demo):
    assert head_is_lm_head(demo, PROMPTS[0], [0])


def oracle(truth: dict[int, list[int]], spoil_every: int = 3):
    """A proposer that drafts each prompt's true continuation with one slot spoiled: rounds
    accept part of a block and reject the rest, so every rewind path runs."""
    calls = {"n": 0}

    def propose(drafter, context, lengths, last, temperature=0.0, gens=None):
        n = drafter.block_size - 1 + int(getattr(drafter, "anchor_predicts", False))
        rows = []
        for S, t in zip(lengths, last):
            seq = truth[(S, t)] if (S, t) in truth else []
            row = (seq + [0] * n)[:n]
            calls["n"] += 1
            j = calls["n"] % spoil_every + 1
            if j < n:
                row[j] = (row[j] + 1) % 7
            rows.append(row)
        return drafting.Proposal(torch.tensor(rows), None)

    return propose


def _truth(target, layers, prompts, new):
    """(anchor position, anchor token) -> the target's greedy continuation after it."""
    fn = target_fn_for(target, layers)
    table = {}
    for p in prompts:
        full = list(p) + plain_greedy(fn, p, new + 8)
        for S in range(len(p), len(full) - 1):
            table[(S, full[S])] = full[S + 1:]
    return table


@pytest.fixture(scope="module", params=["qwen3", "qwen3_5"])
def chat(request, tmp_path_factory, module_thread):
    folder = chat_target(tmp_path_factory.mktemp(request.param),
                         hybrid=request.param == "qwen3_5")
    return load_target(folder, dtype="float32")


def test_the_cache_path_is_lossless_with_rewinds(chat, monkeypatch, tmp_path):
    """eval.cache's path, on an attention-only and a hybrid (Gated DeltaNet) target: greedy
    speculative output equals the target's own, through rounds that keep part of a block."""
    layers = [0, 2]
    prompts = [[5, 17, 3], [1], list(range(10, 40))]
    spec = read_drafter(str(save_dflash(tmp_path / "d", chat.model.config, 0, layers, block=5,
                                        mask=chat.vocab_size - 1)))
    d = load_weights(spec, chat, "cpu")
    monkeypatch.setattr(spec_decode, "propose", oracle(_truth(chat, layers, prompts, NEW)))
    fn = target_fn_for(chat, layers)
    for backend in (CachedRows(chat, layers), FullBatch(chat, layers)):
        rows = decode_rows(backend, d, prompts, DecodeSettings(NEW))
        for r, p in zip(rows, prompts):
            assert r.tokens == plain_greedy(fn, p, NEW)
        assert any(0 < a < max(r.proposed) for r in rows for a in r.acceptance)
    plain = decode_rows(CachedRows(chat, layers), None, prompts, DecodeSettings(NEW))
    assert [r.tokens for r in plain] == [plain_greedy(fn, p, NEW) for p in prompts]


def test_an_acceptance_that_takes_a_wrong_draft_leaves_the_targets_output(demo, drafters,
                                                                         monkeypatch):
    good = decode_rows(FullBatch(demo, DEMO_LAYERS), drafters["dflash"], PROMPTS,
                       DecodeSettings(NEW))
    honest = spec_decode.greedy_accept
    monkeypatch.setattr(spec_decode, "greedy_accept",
                        lambda d, p: min(len(d), honest(d, p) + 1))
    bad = decode_rows(FullBatch(demo, DEMO_LAYERS), drafters["dflash"], PROMPTS,
                      DecodeSettings(NEW))
    assert [r.tokens for r in good] != [r.tokens for r in bad]


@pytest.mark.parametrize("kind", ["dflash", "dspark"])
def test_sampling_is_seeded_per_prompt(demo, drafters, kind):
    d = drafters[kind]
    s = DecodeSettings(NEW, temperature=0.8)

    def run(seed, prompts=PROMPTS, idx=(0, 1, 2)):
        gens = [prompt_generator(seed, i, "cpu") for i in idx]
        return [r.tokens for r in decode_rows(FullBatch(demo, DEMO_LAYERS), d, prompts, s,
                                              gens)]

    a, b = run(7), run(7)
    assert a == b
    assert run(8) != a
    # a prompt's tokens do not depend on the others in its batch
    assert run(7, [PROMPTS[2]], (2,)) == [a[2]]
    plain = [r.tokens for r in decode_rows(
        FullBatch(demo, DEMO_LAYERS), None, PROMPTS, s,
        [prompt_generator(7, i, "cpu") for i in range(3)])]
    assert all(len(t) == NEW for t in plain) and plain != [r for r in run(9)]


def test_each_round_records_its_position_and_the_buckets_count_them(demo, drafters):
    # a short and a long prompt, so the rounds fall on both sides of one edge
    prompts = [list(b"x"), list(b"Built-in functions and the return value of the ")]
    rows = decode_rows(FullBatch(demo, DEMO_LAYERS), drafters["dflash"], prompts,
                       DecodeSettings(10))
    for p, r in zip(prompts, rows):
        # the prompt and the tokens before the round: what the results files rebuild it from
        assert r.positions == round_positions(len(p), r.acceptance)
        assert r.positions[0] == len(p) + 1 and len(r.positions) == len(r.acceptance)
    edge = 20
    recs = by_context(Buckets((edge,), None), [(r.positions, r.acceptance) for r in rows])
    assert [x["rounds"] for x in recs] == [len(rows[0].acceptance), len(rows[1].acceptance)]
    for x, r in zip(recs, rows):
        assert x["accepted"] == sum(r.acceptance)
        assert x["tau"] == pytest.approx(len(r.tokens[1:]) / len(r.acceptance))


def test_counting_whole_rounds_keeps_the_tokens_and_counts_as_vllm_does(demo, drafters,
                                                                         monkeypatch):
    """count_whole: every round drafts the full count, the last one too, and the drafts the
    target accepts are counted whole (vLLM's counters); the tokens kept and our own count are
    those of decoding without it."""
    from dflash_core.served_counts import VllmCounts

    d = drafters["dflash"]
    per_round = d.block_size - 1
    cut = decode_rows(FullBatch(demo, DEMO_LAYERS), d, PROMPTS, DecodeSettings(NEW))
    whole = decode_rows(FullBatch(demo, DEMO_LAYERS), d, PROMPTS,
                        DecodeSettings(NEW, count_whole=True))
    for a, b in zip(cut, whole):
        assert (a.tokens, a.acceptance, a.proposed) == (b.tokens, b.acceptance, b.proposed)
        assert a.served_acceptance == [] and len(b.served_acceptance) == len(b.acceptance)
        for acc, prop, served in zip(b.acceptance, b.proposed, b.served_acceptance):
            assert acc <= served <= per_round
            if acc < prop:  # a draft rejected among those kept (no stop ids here): the same
                assert served == acc
    # a proposer that drafts the target's own continuation: every round accepts all it drafted,
    # counted whole; the last round, cut by the limit, accepts fewer in our count
    truth = _truth(demo, DEMO_LAYERS, PROMPTS, NEW + per_round)

    def perfect(drafter, context, lengths, last, temperature=0.0, gens=None):
        rows = [(truth[(S, t)] + [0] * per_round)[:per_round] for S, t in zip(lengths, last)]
        return drafting.Proposal(torch.tensor(rows), None)

    monkeypatch.setattr(spec_decode, "propose", perfect)
    rows = decode_rows(FullBatch(demo, DEMO_LAYERS), d, PROMPTS[:1],
                       DecodeSettings(NEW, count_whole=True))
    r = rows[0]
    assert len(r.tokens) == NEW and (NEW - 1) % (per_round + 1) != 0  # the limit cuts a round
    assert r.served_acceptance == [per_round] * len(r.acceptance)
    assert r.acceptance[:-1] == [per_round] * (len(r.acceptance) - 1)
    assert r.acceptance[-1] == (NEW - 1) % (per_round + 1) - 1 < per_round
    counts = VllmCounts.of_rounds(r.served_acceptance, per_round)
    assert counts.mean_acceptance_length == 1 + per_round
    assert counts.per_position == [1.0] * per_round
    assert (counts.drafts, counts.draft_tokens) == (len(r.acceptance),
                                                    len(r.acceptance) * per_round)
    ours = (sum(r.acceptance) + len(r.acceptance)) / len(r.acceptance)
    assert ours < counts.mean_acceptance_length  # ours stops at the cut


def test_counting_whole_never_drafts_past_the_target_s_window(demo, drafters):
    """Near the end of the window the last rounds draft what still fits (vLLM trims its drafts
    at max_model_len alike), never fewer than the limit needs; the tokens are the same."""
    d = drafters["dflash"]
    per_round = d.block_size - 1
    p = PROMPTS[0]
    window = len(p) + NEW + 1  # one position past the new tokens: the last rounds are trimmed
    rows = decode_rows(FullBatch(demo, DEMO_LAYERS), d, [p],
                       DecodeSettings(NEW, count_whole=True, positions=window))
    r = rows[0]
    plain = decode_rows(FullBatch(demo, DEMO_LAYERS), d, [p], DecodeSettings(NEW))[0]
    assert r.tokens == plain.tokens and r.acceptance == plain.acceptance
    assert len(r.served_proposed) == len(r.acceptance)
    for pos, n, prop in zip(r.positions, r.served_proposed, r.proposed):
        # a round at position pos feeds its last token and n drafts: positions pos-1 .. pos+n-1
        assert pos + n <= window and prop <= n <= per_round
    assert r.served_proposed[0] == per_round and r.served_proposed[-1] < per_round
