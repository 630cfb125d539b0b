"""Exact greedy speculative decoding: lossless whatever the drafter, and tau measured right."""

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from dflash_core.models.dflash.drafter import DFlashDrafter, build_drafter_config
from dflash_core.eval.evaluate import (
    evaluate_tau,
    hf_target_fn,
    plain_greedy,
    speculative_generate,
    target_fn_for,
)

LAYERS = [0, 2]
VOCAB = 97
MAX_NEW = 20


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    # Tiny matrices: one thread is faster, and far faster on a busy 2-core machine (no spinning).
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def tiny_qwen3(num_layers: int) -> Qwen3ForCausalLM:
    """A tiny seeded Qwen3 target (vocab VOCAB, width 48), eager attention, in eval mode."""
    cfg = Qwen3Config(vocab_size=VOCAB, hidden_size=48, intermediate_size=96,
                      num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=12, attn_implementation="eager")
    torch.manual_seed(0)
    return Qwen3ForCausalLM(cfg).eval()


@pytest.fixture(scope="module")
def target():
    return tiny_qwen3(4)


@pytest.fixture(scope="module")
def target_fn(target):
    return hf_target_fn(target, LAYERS)


@pytest.fixture(scope="module")
def drafter(target):
    cfg = build_drafter_config(target.config, num_layers=1, target_layer_ids=LAYERS, block_size=8,
                               mask_token_id=VOCAB - 1)
    torch.manual_seed(1)
    d = DFlashDrafter(cfg).eval()
    d.attach_target_head(target.get_input_embeddings(), target.get_output_embeddings())
    return d


PROMPTS = [[5, 17, 3], [1], list(range(10, 40)), [60, 61, 62, 60, 61, 62, 7]]


class OracleDrafter:
    """Proposes the target's true greedy continuation: every drafted token is accepted."""

    target_layer_ids = LAYERS

    def __init__(self, target_fn, prompt, block_size):
        self.block_size = block_size
        self.seq = list(prompt) + plain_greedy(target_fn, prompt, MAX_NEW + block_size)
        self.calls = 0

    def draft(self, context, last_token, num_tokens=None):
        self.calls += 1
        S = context.shape[1]  # last_token sits at position S
        assert self.seq[S] == last_token
        n = num_tokens or self.block_size - 1
        return torch.tensor(self.seq[S + 1 : S + 1 + n])


class WrongAtDrafter(OracleDrafter):
    """The true continuation with one wrong token, at slot ``calls % block_size`` (none when that
    is past the block): exercises partial acceptance and the rollback of rejected tokens."""

    def draft(self, context, last_token, num_tokens=None):
        out = super().draft(context, last_token, num_tokens).clone()
        j = (self.calls - 1) % self.block_size
        if j < len(out):
            out[j] = (out[j] + 1) % VOCAB
        self.expected.append(min(j, len(out)))
        return out

    expected: list


class CountingDrafter:
    """Wraps a drafter and counts calls (block size 1 must never call it)."""

    def __init__(self, inner):
        self.inner, self.calls = inner, 0
        self.block_size, self.target_layer_ids = inner.block_size, inner.target_layer_ids

    def draft(self, *args, **kw):
        self.calls += 1
        return self.inner.draft(*args, **kw)


@pytest.mark.parametrize("block_size", [2, 4, 8])
def test_lossless_with_a_random_drafter(target_fn, drafter, block_size):
    for prompt in PROMPTS:
        ref = plain_greedy(target_fn, prompt, MAX_NEW)
        got = speculative_generate(target_fn, drafter, prompt, MAX_NEW, LAYERS, block_size)
        assert got.tokens == ref
        assert all(0 <= a <= block_size - 1 for a in got.acceptance)
        assert got.tau >= 1.0
        # every new token but the prefill one came from a round: accepted + bonus
        assert sum(a + 1 for a in got.acceptance) == MAX_NEW - 1


@pytest.mark.parametrize("block_size", [3, 8])
def test_partial_acceptance_rolls_back(target_fn, block_size):
    for prompt in PROMPTS:
        d = WrongAtDrafter(target_fn, prompt, block_size)
        d.expected = []
        got = speculative_generate(target_fn, d, prompt, MAX_NEW, LAYERS)
        assert got.tokens == plain_greedy(target_fn, prompt, MAX_NEW)
        # A last round with one token left drafts nothing (the bonus token fills it).
        assert got.acceptance == d.expected + [0] * (got.rounds - len(d.expected))
        assert len(set(got.acceptance)) > 1


def test_greedy_output_is_not_trivial(target_fn):
    # A constant continuation would make the lossless test weak.
    assert len(set(plain_greedy(target_fn, PROMPTS[0], MAX_NEW))) > 3


def test_tensor_prompt_and_eos(target_fn, drafter):
    prompt = torch.tensor([[5, 17, 3]])
    ref = plain_greedy(target_fn, prompt, MAX_NEW)
    eos = ref[6]
    stop_ref = plain_greedy(target_fn, prompt, MAX_NEW, eos_token_id=eos)
    assert stop_ref == ref[: ref.index(eos) + 1]
    got = speculative_generate(target_fn, drafter, prompt, MAX_NEW, LAYERS, eos_token_id=eos)
    assert got.tokens == stop_ref


@pytest.mark.parametrize("block_size", [4, 8])
def test_oracle_drafter_reaches_block_size(target_fn, block_size):
    for prompt in PROMPTS:
        oracle = OracleDrafter(target_fn, prompt, block_size)
        got = speculative_generate(target_fn, oracle, prompt, MAX_NEW, LAYERS)
        assert got.tokens == oracle.seq[len(prompt) : len(prompt) + MAX_NEW]
        assert got.acceptance[:-1] == [block_size - 1] * (got.rounds - 1)
        assert 0 <= got.acceptance[-1] <= block_size - 1  # truncated by max_new_tokens
    summary = evaluate_tau(target_fn, None, [], MAX_NEW, LAYERS, block_size)
    assert summary.tau == 0.0 and summary.rounds == 0


def test_oracle_tau_summary(target_fn):
    B = 4
    n = 1 + 3 * B  # prefill token + three full rounds
    oracle = OracleDrafter(target_fn, PROMPTS[0], B)
    summary = evaluate_tau(target_fn, oracle, [PROMPTS[0]], n, LAYERS)
    assert summary.tau == B
    assert summary.acceptance == [0, 0, 0, 3]
    assert summary.tokens == n and summary.prompts == 1 and summary.rounds == 3


def test_block_size_one_is_plain_decoding(target_fn, drafter):
    counting = CountingDrafter(drafter)
    s = evaluate_tau(target_fn, counting, PROMPTS, MAX_NEW, LAYERS, block_size=1)
    assert counting.calls == 0
    assert s.tau == 1.0 and s.acceptance == [s.rounds] and s.rounds == len(PROMPTS) * (MAX_NEW - 1)
    r = speculative_generate(target_fn, None, PROMPTS[0], MAX_NEW, block_size=1)
    assert r.tokens == plain_greedy(target_fn, PROMPTS[0], MAX_NEW)
    assert set(r.acceptance) == {0}


def test_histogram_and_tau_agree(target_fn, drafter):
    s = evaluate_tau(target_fn, drafter, PROMPTS, MAX_NEW, LAYERS)
    assert len(s.acceptance) == drafter.block_size
    assert sum(s.acceptance) == s.rounds
    assert s.tau == pytest.approx(sum((k + 1) * c for k, c in enumerate(s.acceptance)) / s.rounds)
    assert s.tokens == len(PROMPTS) * MAX_NEW
    assert s.tau >= 1.0


def test_mismatched_layers_and_block_size_are_refused(target_fn, drafter):
    with pytest.raises(ValueError, match="layers"):
        speculative_generate(target_fn, drafter, [1, 2], 4, [1, 3])
    with pytest.raises(ValueError, match="block size"):
        speculative_generate(target_fn, drafter, [1, 2], 4, LAYERS, block_size=16)


def test_target_fn_for_adapts_a_target_model(target, target_fn):
    calls = []

    class FakeTargetModel:  # the shape of target.TargetModel.logits_and_features
        def logits_and_features(self, input_ids, layer_ids=None):
            calls.append(layer_ids)
            return target_fn(input_ids)

    fn = target_fn_for(FakeTargetModel(), LAYERS)
    assert plain_greedy(fn, [1, 2, 3], 5) == plain_greedy(target_fn, [1, 2, 3], 5)
    assert calls and all(c == LAYERS for c in calls)


def _self_consistent_text(target_fn, drafter, prompt, rounds):
    """prompt + a first token, then ``rounds`` times the drafter's own full proposal after the
    last token: exact decoding of this text would accept every drafted token of every round."""
    ids = list(prompt) + plain_greedy(target_fn, prompt, 1)
    starts = []
    for _ in range(rounds):
        starts.append(len(ids) - 1)
        _, feats = target_fn(torch.tensor([ids]))
        ids += drafter.draft(feats[:, : len(ids) - 1], ids[-1]).tolist()
    return ids, starts


def test_teacher_forced_eval_makes_the_pass_decoding_makes(target, target_fn, drafter):
    from dflash_core.eval.evaluate import teacher_forced_eval

    B = drafter.block_size
    prompt = PROMPTS[2]
    ids, starts = _self_consistent_text(target_fn, drafter, prompt, rounds=3)
    mask = [0] * len(prompt) + [1] * (len(ids) - len(prompt))
    features = lambda x: target_fn(x)[1]  # noqa: E731
    tau, blocks = teacher_forced_eval(features, drafter, [(ids, mask)])
    assert blocks == len(ids) - len(prompt) - 1  # an anchor at every valid position
    # Each block scores what a decoding round started at its anchor would accept.
    _, feats = target_fn(torch.tensor([ids]))
    rounds = []
    for S in range(len(prompt), len(ids) - 1):
        n = min(B - 1, len(ids) - 1 - S)
        drafted = drafter.draft(feats[:, :S], ids[S], n).tolist()
        k = 0
        while k < n and drafted[k] == ids[S + 1 + k]:
            k += 1
        rounds.append(k + 1)
    assert tau == pytest.approx(sum(rounds) / len(rounds))
    assert all(rounds[S - len(prompt)] == B for S in starts)  # the drafter's own text: all
    # at the anchors decoding used: what those rounds accepted
    assert teacher_forced_eval(features, drafter, [(ids, mask)], anchors=[starts]) == (B, 3)
    ev = evaluate_tau(target_fn, drafter, [prompt], 12, LAYERS)
    (out,), (at,) = ev.outputs, ev.anchors
    assert at[0] == len(prompt) and len(at) == ev.rounds
    decoded = [(prompt + out, [0] * len(prompt) + [1] * len(out))]
    tau_b, rounds_b = teacher_forced_eval(features, drafter, decoded, anchors=[at])
    # every round but a last one with nothing left to draft has a labelled block
    assert rounds_b >= ev.rounds - 1 and tau_b * rounds_b == pytest.approx(
        sum((k + 1) * c for k, c in enumerate(ev.acceptance)) - (ev.rounds - rounds_b))
    assert teacher_forced_eval(features, drafter, [(prompt, [0] * len(prompt))]) == (0.0, 0)
