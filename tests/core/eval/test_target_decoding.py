"""Decoding with the target's cache gives what full forwards give: the same tokens, the same
acceptance, the same features for the drafter, on an attention-only (Qwen3) and a hybrid (Qwen3.5,
Gated DeltaNet) target, whatever the drafter accepts."""

import pytest
import torch
from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig, Qwen3Config, Qwen3ForCausalLM

from dflash_core.models.dflash.drafter import DFlashDrafter, build_drafter_config
from dflash_core.eval.evaluate import evaluate_tau, plain_greedy, speculative_generate, target_fn_for
from dflash_core.models.target.model import TargetModel
from dflash_core.eval.target_decoding import CachedDecoding, attention_only
from tests.core.eval.test_evaluate import one_thread  # noqa: F401 - autouse: one thread

VOCAB, LAYERS, MAX_NEW, BLOCK = 97, [0, 2], 24, 6
COMMON = dict(vocab_size=VOCAB, hidden_size=48, intermediate_size=96, num_hidden_layers=4,
              num_attention_heads=4, num_key_value_heads=2, head_dim=12,
              tie_word_embeddings=False)
PROMPTS = [[5, 17, 3], [1], list(range(10, 40))]


def _qwen3():
    torch.manual_seed(0)
    return Qwen3ForCausalLM(Qwen3Config(**COMMON, attn_implementation="eager")).eval()


def _qwen35():
    torch.manual_seed(1)
    cfg = Qwen3_5TextConfig(**COMMON, linear_key_head_dim=12, linear_value_head_dim=12,
                            linear_num_key_heads=2, linear_num_value_heads=4)
    model = Qwen3_5ForCausalLM(cfg).eval()
    assert {"linear_attention", "full_attention"} <= set(model.config.layer_types)
    return model


@pytest.fixture(scope="module", params=["qwen3", "qwen3_5"])
def target(request):
    return TargetModel({"qwen3": _qwen3, "qwen3_5": _qwen35}[request.param]())


@pytest.fixture(scope="module")
def drafter(target):
    cfg = build_drafter_config(target.model.config, num_layers=1, target_layer_ids=LAYERS,
                               block_size=BLOCK, mask_token_id=VOCAB - 1)
    torch.manual_seed(2)
    d = DFlashDrafter(cfg).eval()
    d.attach_target_head(target.embed_tokens, target.lm_head)
    return d


class Recording:
    """A drafter whose contexts are kept; ``wrong_at`` spoils one slot per round (partial
    acceptance, so every round rewinds), or proposes the target's own text when ``truth``."""

    def __init__(self, inner, truth=None):
        self.inner, self.truth, self.contexts, self.calls = inner, truth, [], 0
        self.block_size, self.target_layer_ids = inner.block_size, inner.target_layer_ids

    def parameters(self):
        return self.inner.parameters()

    def draft(self, context, last_token, num_tokens=None):
        self.contexts.append(context.clone())
        self.calls += 1
        if self.truth is None:
            return self.inner.draft(context, last_token, num_tokens)
        S, n = context.shape[1], num_tokens or self.block_size - 1
        out = torch.tensor(self.truth[S + 1:S + 1 + n])
        j = self.calls % self.block_size
        if j < len(out):
            out[j] = (out[j] + 1) % VOCAB
        return out


def test_attention_only_is_read_from_the_layer_kinds(target):
    assert attention_only(target.text_config) == (target.text_config.model_type == "qwen3")


@pytest.mark.parametrize("oracle", [False, True], ids=["model-drafter", "spoiled-oracle"])
@pytest.mark.parametrize("prompt", PROMPTS, ids=["three", "one", "thirty"])
def test_cached_decoding_equals_full_forwards(target, drafter, prompt, oracle):
    full_fn = target_fn_for(target, LAYERS)
    truth = list(prompt) + plain_greedy(full_fn, prompt, MAX_NEW + BLOCK) if oracle else None
    runs = {}
    for cache in (False, True):
        rec = Recording(drafter, truth)
        runs[cache] = (speculative_generate(target_fn_for(target, LAYERS, cache=cache), rec,
                                            prompt, MAX_NEW, LAYERS), rec.contexts)
    (full, ctx_full), (cached, ctx_cached) = runs[False], runs[True]
    assert cached.tokens == full.tokens == plain_greedy(full_fn, prompt, MAX_NEW)
    assert cached.acceptance == full.acceptance
    if oracle:  # every round accepted something and rejected the rest: rewinds were exercised
        assert any(0 < a < BLOCK - 1 for a in cached.acceptance)
    assert len(ctx_cached) == len(ctx_full)
    for a, b in zip(ctx_cached, ctx_full):
        assert a.shape == b.shape
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_the_evaluation_summary_is_the_same_with_the_cache(target, drafter):
    a = evaluate_tau(target_fn_for(target, LAYERS), drafter, PROMPTS, MAX_NEW, LAYERS)
    b = evaluate_tau(target_fn_for(target, LAYERS, cache=True), drafter, PROMPTS, MAX_NEW, LAYERS)
    assert (a.tau, a.acceptance, a.outputs, a.anchors) == (b.tau, b.acceptance, b.outputs, b.anchors)


def test_cached_decoding_feeds_each_token_about_once(target, drafter, monkeypatch):
    fed = []
    step = target.decode_step
    monkeypatch.setattr(target, "decode_step", lambda ids, *a, **k: fed.append(ids.shape[1])
                        or step(ids, *a, **k))
    prompt = PROMPTS[2]
    res = speculative_generate(target_fn_for(target, LAYERS, cache=True), drafter, prompt,
                               MAX_NEW, LAYERS)
    assert fed[0] == len(prompt) and max(fed[1:]) <= BLOCK  # the prompt once, then blocks
    # A verification feeds a block; a hybrid target also feeds the accepted tokens again.
    refeeds = 0 if attention_only(target.text_config) else res.rounds
    assert len(fed) <= 1 + res.rounds + refeeds


def test_a_rewind_past_what_the_last_feed_kept_is_refused_on_a_hybrid_target():
    dec = CachedDecoding(TargetModel(_qwen35()), LAYERS)
    assert not dec.croppable
    dec.feed([1, 2, 3, 4])
    dec.feed([5, 6])
    dec.rewind(5)  # within the last feed: from the copy, token 5 fed again
    assert dec.tokens == [1, 2, 3, 4, 5] and dec.features().shape[1] == 5
    with pytest.raises(RuntimeError, match="cannot rewind to 2 tokens"):
        dec.rewind(2)
