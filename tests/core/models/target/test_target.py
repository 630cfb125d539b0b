"""dflash_core.models.target.model on tiny random-weight Qwen3 and Qwen3.5 (hybrid Gated DeltaNet) checkpoints,
saved to disk and loaded back through the real transformers path."""

from __future__ import annotations

import threading

import pytest
import torch
from torch import nn
from transformers import (
    Qwen3_5Config, Qwen3_5ForCausalLM, Qwen3_5ForConditionalGeneration, Qwen3_5TextConfig,
    Qwen3Config, Qwen3ForCausalLM,
)

from dflash_core.models.target.model import ForwardInterrupted, TargetModel
from dflash_core.models.target.load import load_target

VOCAB, HIDDEN, LAYERS = 256, 64, 6
COMMON = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=LAYERS,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16,
              tie_word_embeddings=False)
QWEN35_TEXT = dict(COMMON, linear_key_head_dim=16, linear_value_head_dim=16,
                   linear_num_key_heads=2, linear_num_value_heads=4)


def _qwen3() -> nn.Module:
    torch.manual_seed(0)
    return Qwen3ForCausalLM(Qwen3Config(**COMMON)).eval()


def _qwen35() -> nn.Module:
    torch.manual_seed(1)
    model = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**QWEN35_TEXT)).eval()
    # Both layer kinds must be in play, or the test would not cover the hybrid model.
    assert {"linear_attention", "full_attention"} <= set(model.config.layer_types)
    return model


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """{family: (folder, the in-memory model it was saved from)}; qwen3_5 sharded."""
    root = tmp_path_factory.mktemp("targets")
    out = {}
    for name, build, shard in (("qwen3", _qwen3, None), ("qwen3_5", _qwen35, "150KB")):
        model = build()
        kwargs = {"max_shard_size": shard} if shard else {}
        model.save_pretrained(root / name, safe_serialization=True, **kwargs)
        out[name] = (root / name, model)
    assert len(list((root / "qwen3_5").glob("*.safetensors"))) > 2
    assert (root / "qwen3_5" / "model.safetensors.index.json").is_file()
    return out


@pytest.fixture(scope="module")
def loaded(checkpoints):
    return {name: (load_target(folder), ref) for name, (folder, ref) in checkpoints.items()}


FAMILIES = ["qwen3", "qwen3_5"]


def _hidden_states(model, input_ids, attention_mask=None):
    with torch.inference_mode():
        return model(input_ids=input_ids, attention_mask=attention_mask,
                     output_hidden_states=True).hidden_states


@pytest.mark.parametrize("family", FAMILIES)
def test_loaded_model_is_frozen_and_described(loaded, family):
    target, ref = loaded[family]
    assert type(target.model) is type(ref)
    assert (target.num_layers, target.hidden_size, target.vocab_size) == (LAYERS, HIDDEN, VOCAB)
    assert target.device == torch.device("cpu") and target.dtype == torch.float32
    assert isinstance(target.embed_tokens, nn.Embedding)
    assert isinstance(target.lm_head, nn.Linear)
    assert not target.model.training
    assert not any(p.requires_grad for p in target.model.parameters())
    # The weights are the saved ones, not a fresh initialisation.
    ref_state = ref.state_dict()
    for key, value in target.model.state_dict().items():
        assert torch.equal(value, ref_state[key]), key


@pytest.mark.parametrize("family", FAMILIES)
def test_features_equal_hf_hidden_states(loaded, family):
    target, ref = loaded[family]
    ids = torch.randint(0, VOCAB, (2, 11), generator=torch.Generator().manual_seed(2))
    hs = _hidden_states(ref, ids)
    layer_ids = [3, 0, 4]  # any order; the output keeps it
    feats = target.features(ids, layer_ids=layer_ids)
    assert feats.shape == (2, 11, len(layer_ids) * HIDDEN)
    expected = torch.cat([hs[i + 1] for i in layer_ids], dim=-1)
    assert (feats - expected).abs().max().item() < 1e-5
    # HF's last hidden state has the final norm applied, and so has ours: the reference reads
    # hidden_states[i+1] for every layer, the last one too.
    last = target.features(ids, layer_ids=[LAYERS - 1])
    assert (last - hs[LAYERS]).abs().max().item() < 1e-5
    with torch.inference_mode():
        logits = ref(input_ids=ids).logits
        again = ref.lm_head(last)
    assert (again - logits).abs().max().item() < 1e-4


@pytest.mark.parametrize("family", FAMILIES)
def test_features_skip_lm_head_norm_and_later_layers(loaded, family, monkeypatch):
    target, _ = loaded[family]

    def no_logits(*args, **kwargs):
        raise AssertionError("lm_head ran during features()")

    monkeypatch.setattr(target.lm_head, "forward", no_logits)
    calls = [0] * LAYERS
    norm_calls = []
    handles = [layer.register_forward_hook(lambda m, a, o, i=i: calls.__setitem__(i, calls[i] + 1))
               for i, layer in enumerate(target.layers)]
    handles.append(target.decoder.norm.register_forward_hook(lambda *a: norm_calls.append(1)))
    try:
        ids = torch.randint(0, VOCAB, (1, 9))
        feats = target.features(ids, layer_ids=[1, 2])
    finally:
        for h in handles:
            h.remove()
    assert feats.shape == (1, 9, 2 * HIDDEN)
    assert calls == [1, 1, 1, 0, 0, 0]
    assert norm_calls == []
    assert not any(layer._forward_hooks for layer in target.layers)  # features() cleaned up
    # The patch does catch a call: the evaluation forward goes through the lm_head.
    with pytest.raises(AssertionError, match="lm_head ran"):
        target.logits_and_features(ids, [1])


@pytest.mark.parametrize("family", FAMILIES)
def test_stop_interrupts_features_between_layers(loaded, family):
    target, _ = loaded[family]
    stop, calls = threading.Event(), [0] * LAYERS

    def count(m, a, o, i):
        calls[i] += 1
        if i == 1:
            stop.set()  # an abort arrives while layer 1 runs
    handles = [layer.register_forward_hook(lambda m, a, o, i=i: count(m, a, o, i))
               for i, layer in enumerate(target.layers)]
    ids = torch.randint(0, VOCAB, (1, 9))
    try:
        with pytest.raises(ForwardInterrupted):
            target.features(ids, layer_ids=[1, 4], stop=stop)
    finally:
        for h in handles:
            h.remove()
    assert calls == [1, 1, 0, 0, 0, 0]  # layer 2 onwards never ran
    assert not any(layer._forward_pre_hooks or layer._forward_hooks for layer in target.layers)
    stop.clear()  # the same model serves the next run
    assert target.features(ids, layer_ids=[1, 4], stop=stop).shape == (1, 9, 2 * HIDDEN)


@pytest.mark.parametrize("family", FAMILIES)
def test_padded_batch_equals_each_sequence_alone(loaded, family):
    target, _ = loaded[family]
    gen = torch.Generator().manual_seed(3)
    lengths = [13, 8, 3]
    seqs = [torch.randint(1, VOCAB, (n,), generator=gen) for n in lengths]
    ids = torch.zeros(len(seqs), max(lengths), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, seq in enumerate(seqs):
        ids[row, :len(seq)] = seq
        mask[row, :len(seq)] = 1
    layer_ids = [0, 2, 5]
    batch = target.features(ids, mask, layer_ids)
    for row, seq in enumerate(seqs):
        alone = target.features(seq[None], layer_ids=layer_ids)[0]
        diff = (batch[row, :len(seq)] - alone).abs().max().item()
        assert diff < 1e-5, (row, diff)
    # Pad positions are garbage by contract, but must not be NaN (a fully masked row could be).
    assert batch.shape == (3, 13, 3 * HIDDEN) and torch.isfinite(batch).all()


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_and_features(loaded, family):
    target, ref = loaded[family]
    ids = torch.randint(0, VOCAB, (2, 10), generator=torch.Generator().manual_seed(4))
    logits, feats = target.logits_and_features(ids, [1, 4])
    with torch.inference_mode():
        ref_logits = ref(input_ids=ids).logits
    assert logits.shape == (2, 10, VOCAB)
    assert (logits - ref_logits).abs().max().item() < 1e-5
    assert (feats - target.features(ids, layer_ids=[1, 4])).abs().max().item() < 1e-6


def test_features_can_feed_a_trained_layer(loaded):
    target, _ = loaded["qwen3"]
    feats = target.features(torch.randint(0, VOCAB, (1, 5)), layer_ids=[0, 1])
    assert not feats.is_inference() and not feats.requires_grad
    fc = nn.Linear(2 * HIDDEN, HIDDEN, bias=False)
    fc(feats).square().sum().backward()  # an inference tensor could not be saved for backward
    assert fc.weight.grad is not None and fc.weight.grad.abs().sum() > 0


def test_bad_layer_ids_are_refused(loaded):
    target, _ = loaded["qwen3"]
    ids = torch.randint(0, VOCAB, (1, 4))
    for bad in ([], [LAYERS], [-1]):
        with pytest.raises(ValueError, match="layer ids"):
            target.features(ids, layer_ids=bad)


def test_multimodal_qwen35_checkpoint_loads_its_text_model(tmp_path):
    """Qwen3.5 / 3.6 releases are image-text checkpoints; the target is their language model."""
    torch.manual_seed(5)
    config = Qwen3_5Config(
        text_config=QWEN35_TEXT,
        vision_config=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2,
                           out_hidden_size=HIDDEN, patch_size=4, num_position_embeddings=16),
        image_token_id=250, video_token_id=251, vision_start_token_id=252,
        vision_end_token_id=253)
    vlm = Qwen3_5ForConditionalGeneration(config).eval()
    vlm.save_pretrained(tmp_path, safe_serialization=True)
    target = load_target(tmp_path)
    assert isinstance(target.model, Qwen3_5ForCausalLM)
    assert target.num_layers == LAYERS
    ids = torch.randint(0, 200, (2, 9), generator=torch.Generator().manual_seed(6))
    with torch.inference_mode():
        out = vlm(input_ids=ids, output_hidden_states=True)
    logits, feats = target.logits_and_features(ids, [1, 3])
    assert (logits - out.logits).abs().max().item() < 1e-5
    expected = torch.cat([out.hidden_states[2], out.hidden_states[4]], dim=-1)
    assert (feats - expected).abs().max().item() < 1e-5


def test_wraps_an_in_memory_model():
    """The demo builds its tiny target on the spot; TargetModel takes it as it is."""
    model = _qwen3().train()
    target = TargetModel(model)
    assert not model.training and not any(p.requires_grad for p in model.parameters())
    hs = _hidden_states(model, torch.arange(6)[None])
    feats = target.features(torch.arange(6)[None], layer_ids=[2])
    assert (feats - hs[3]).abs().max().item() < 1e-5


def test_features_and_an_evaluation_forward_in_two_threads_do_not_mix(loaded):
    # The engine's evaluation (on a drafter thread) runs the target while the target thread
    # extracts features from the same modules; their layer hooks must not see each other.
    target, _ = loaded["qwen3"]
    ids_a, ids_b = torch.randint(0, VOCAB, (2, 64)), torch.randint(0, VOCAB, (1, 40))
    want_a = target.features(ids_a, layer_ids=[1, 2])
    want_logits, want_b = target.logits_and_features(ids_b, [1, 2])
    errors = []

    def features():
        assert torch.equal(target.features(ids_a, layer_ids=[1, 2], stop=threading.Event()),
                           want_a)

    def evaluation():
        logits, feats = target.logits_and_features(ids_b, [1, 2])
        assert torch.equal(feats, want_b) and torch.equal(logits, want_logits)

    def repeat(fn):
        try:
            for _ in range(200):
                fn()
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=repeat, args=(fn,)) for fn in (features, evaluation)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[:2]

