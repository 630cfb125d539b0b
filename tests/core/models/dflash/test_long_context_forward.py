"""What the drafter's forward does for long samples (drafter.py): its layers recomputed in
backward (drafter.recompute) give the same loss and gradients as kept ones, and under autocast the
context is cast once for every layer (_SharedCast) with the numbers autocast's own per-layer casts
give: the same bits. On a tiny drafter on the CPU, float32 (and CPU bf16 autocast for the
casts)."""

import pytest
import torch

from dflash_core.models import objective as obj
from dflash_core.models.dflash import drafter as drafter_mod
from dflash_core.models.dflash.drafter import DFlashDrafter

from .test_drafter import make_drafter


def _inputs(m: DFlashDrafter, seed: int = 0, S: int = 40):
    g = torch.Generator().manual_seed(seed)
    B = m.block_size
    anchors = torch.tensor([[3, 9, 17, 30], [5, 22, -1, -1]])
    ids = torch.randint(0, 299, (2, S), generator=g)
    mask = torch.ones(2, S, dtype=torch.long)
    labels = obj.block_labels(ids, mask, anchors, B)
    ctx = torch.randn(2, S, 192, generator=g)
    emb = torch.randn(2, anchors.shape[1] * B, 64, generator=g)
    pos = (anchors.clamp(min=0)[:, :, None] + torch.arange(B)).view(2, -1)
    head = torch.randn(300, 64, generator=g) * 0.1
    return ctx, emb, pos, anchors, labels, head


def _loss_and_grads(m: DFlashDrafter, recompute: bool, autocast: bool = False):
    ctx, emb, pos, anchors, labels, head = _inputs(m)
    ctx.requires_grad_(True)
    m.recompute = recompute
    m.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        hidden = m(ctx, emb, pos, anchors)
    loss = obj.chunked_loss(hidden.float(), labels, head, gamma=4.0, chunk=16).loss
    loss.backward()
    grads = {n: p.grad.clone() for n, p in m.named_parameters()}
    return loss.detach(), grads, ctx.grad.clone()


def test_recomputed_layers_give_the_same_loss_and_gradients():
    m = make_drafter(seed=7, layers=3).train()
    kept = _loss_and_grads(m, recompute=False)
    again = _loss_and_grads(m, recompute=True)
    assert again[0] == kept[0]  # the same forward
    assert set(again[1]) == set(kept[1]) and len(kept[1]) > 10
    for name, g in kept[1].items():
        assert g.abs().sum() > 0, name  # every weight learns from this loss
        assert torch.equal(again[1][name], g), name  # the same ops again: the same bits
    assert torch.equal(again[2], kept[2])  # the features' gradient


def test_recompute_is_only_for_training():
    """Under no_grad (drafting, evaluation) nothing is kept, so nothing is recomputed."""
    m = make_drafter(seed=2)
    m.recompute = True
    ctx, emb, pos, anchors, _, _ = _inputs(m)
    calls = []
    real = drafter_mod.checkpoint
    try:
        drafter_mod.checkpoint = lambda *a, **k: calls.append(1) or real(*a, **k)
        with torch.no_grad():
            out = m(ctx, emb, pos, anchors)
        assert calls == []
        m(ctx, emb, pos, anchors)
        assert len(calls) == len(m.layers)  # with gradients: every layer through checkpoint
    finally:
        drafter_mod.checkpoint = real
    m.recompute = False
    with torch.no_grad():
        assert torch.equal(m(ctx, emb, pos, anchors), out)


def _autocast_forward_per_layer_casts(self, context, block_embeds, block_positions, anchors):
    """The forward as it was before the shared cast: the float32 context handed to every layer,
    whose projections then cast it under autocast (a copy each); the features cast to fc's
    dtype first."""
    n, S, _ = context.shape
    positions = torch.arange(S, device=context.device).expand(n, S)
    ctx = self.hidden_norm(self.fc(context.to(self.fc.weight.dtype)))
    x = block_embeds
    rope_ctx = self.rotary_emb(ctx, positions)
    rope_blk = self.rotary_emb(x, block_positions)
    for layer in self.layers:
        x = layer(x, ctx, rope_blk, rope_ctx, anchors, self.block_size, "chunked", None)
    return self.norm(x)


@pytest.mark.parametrize("recompute", [False, True])
def test_the_shared_context_cast_gives_autocasts_numbers(monkeypatch, recompute):
    m = make_drafter(seed=11, layers=3).train()
    ours = _loss_and_grads(m, recompute=recompute, autocast=True)
    monkeypatch.setattr(DFlashDrafter, "forward", _autocast_forward_per_layer_casts)
    before = _loss_and_grads(m, recompute=False, autocast=True)
    assert ours[0] == before[0]
    for name, g in before[1].items():
        assert torch.equal(ours[1][name], g), name
    # the features' gradient, summed over the projections in float32 either way (summed in
    # bf16, as one shared handle for k_proj and v_proj would, fc's gradient came out 1% off)
    assert ours[2].dtype == before[2].dtype == torch.float32
    assert torch.equal(ours[2], before[2])
