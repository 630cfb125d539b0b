"""TargetModel.features(..., with_last_hidden=True): the layer features plus the target's last
hidden state after its final norm (what DSpark scores the target's distribution from), on tiny
Qwen3 and Qwen3.5 (hybrid) checkpoints loaded through transformers."""

from __future__ import annotations

import threading

import pytest
import torch
from torch import nn

from dflash_core.models.target.model import TargetModel
from dflash_core.models.target.config import TargetLoadError

from .test_target import FAMILIES, HIDDEN, LAYERS, VOCAB, _qwen3, checkpoints, loaded  # noqa: F401


def _hf(model, ids, mask=None):
    with torch.inference_mode():
        return model(input_ids=ids, attention_mask=mask, output_hidden_states=True)


@pytest.mark.parametrize("family", FAMILIES)
def test_last_hidden_is_hf_last_hidden_state(loaded, family):
    target, ref = loaded[family]
    ids = torch.randint(0, VOCAB, (2, 11), generator=torch.Generator().manual_seed(5))
    layer_ids = [0, 2]
    feats = target.features(ids, layer_ids=layer_ids, with_last_hidden=True)
    assert feats.shape == (2, 11, (len(layer_ids) + 1) * HIDDEN)
    out = _hf(ref, ids)
    with torch.inference_mode():
        base = ref.model(input_ids=ids).last_hidden_state
    last = feats[..., -HIDDEN:]
    assert (last - base).abs().max().item() < 1e-5
    assert (last - out.hidden_states[-1]).abs().max().item() < 1e-5
    # lm_head of it is the target's logits: the distribution DSpark trains against
    with torch.inference_mode():
        again = ref.lm_head(last)
    assert (again - out.logits).abs().max().item() < 1e-4
    # the layer features in front are those of features() without it
    assert torch.equal(feats[..., :-HIDDEN], target.features(ids, layer_ids=layer_ids))
    assert not feats.is_inference()


@pytest.mark.parametrize("family", FAMILIES)
def test_last_hidden_runs_every_layer_and_the_norm_never_the_lm_head(loaded, family,
                                                                     monkeypatch):
    target, _ = loaded[family]

    def no_logits(*args, **kwargs):
        raise AssertionError("lm_head ran during features()")

    monkeypatch.setattr(target.lm_head, "forward", no_logits)
    calls, norms = [0] * LAYERS, []
    handles = [layer.register_forward_hook(lambda m, a, o, i=i: calls.__setitem__(i, calls[i] + 1))
               for i, layer in enumerate(target.layers)]
    handles.append(target.final_norm.register_forward_hook(lambda *a: norms.append(1)))
    try:
        target.features(torch.randint(0, VOCAB, (1, 7)), layer_ids=[1], with_last_hidden=True)
    finally:
        for h in handles:
            h.remove()
    assert calls == [1] * LAYERS and norms == [1]
    # features() left no hook of its own behind (the norm's included)
    assert not target.final_norm._forward_hooks
    assert not any(layer._forward_hooks for layer in target.layers)


@pytest.mark.parametrize("family", FAMILIES)
def test_last_hidden_of_a_padded_batch_equals_each_sequence_alone(loaded, family):
    target, _ = loaded[family]
    gen = torch.Generator().manual_seed(6)
    lengths = [12, 5]
    seqs = [torch.randint(1, VOCAB, (n,), generator=gen) for n in lengths]
    ids = torch.zeros(2, 12, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, seq in enumerate(seqs):
        ids[row, :len(seq)] = seq
        mask[row, :len(seq)] = 1
    batch = target.features(ids, mask, [1, 3], with_last_hidden=True)
    for row, seq in enumerate(seqs):
        alone = target.features(seq[None], layer_ids=[1, 3], with_last_hidden=True)[0]
        assert (batch[row, :len(seq)] - alone).abs().max().item() < 1e-5


def test_last_layer_chosen_and_last_hidden_agree(loaded):
    """The last layer's feature is HF's hidden_states[N] (post-norm), so with it chosen the two
    trailing H-blocks are the same state."""
    target, _ = loaded["qwen3"]
    ids = torch.randint(0, VOCAB, (1, 6))
    feats = target.features(ids, layer_ids=[LAYERS - 1], with_last_hidden=True)
    assert (feats[..., :HIDDEN] - feats[..., HIDDEN:]).abs().max().item() < 1e-6


def test_another_threads_forward_does_not_capture_the_last_hidden(loaded):
    """The norm hook acts in its own thread only: a plain features() running beside it (the
    evaluation beside a target thread) neither gets nor disturbs the other's state."""
    target, _ = loaded["qwen3"]
    ids = torch.randint(0, VOCAB, (1, 8), generator=torch.Generator().manual_seed(7))
    want = target.features(ids, layer_ids=[1], with_last_hidden=True)
    got, errors = [], []

    def other():
        try:
            for _ in range(5):
                got.append(target.features(ids, layer_ids=[1]))
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)
    t = threading.Thread(target=other)
    t.start()
    for _ in range(5):
        assert torch.equal(target.features(ids, layer_ids=[1], with_last_hidden=True), want)
    t.join()
    assert not errors and all(g.shape == (1, 8, HIDDEN) for g in got)


def test_a_model_without_an_lm_head_is_one_line():
    model = _qwen3()
    model.lm_head = None  # get_output_embeddings() then gives None
    with pytest.raises(TargetLoadError, match="no lm_head the engine can find") as exc:
        TargetModel(model)
    assert "target.path" in exc.value.hint


def test_a_norm_that_does_not_run_is_named(monkeypatch):
    """A decoder whose final norm the forward bypasses cannot give DSpark its state."""
    model = _qwen3()
    tm = TargetModel(model)
    tm.final_norm = nn.LayerNorm(HIDDEN)  # found, but not the module the forward calls
    with pytest.raises(TargetLoadError, match="final norm .* did not run"):
        tm.features(torch.randint(0, VOCAB, (1, 4)), layer_ids=[1], with_last_hidden=True)
