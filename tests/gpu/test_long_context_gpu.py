"""Long samples on the GPU path (issue 47): the drafter's layers recomputed in backward through
compiled FlexAttention under bf16 autocast give the step the layers kept give, and hold less;
a sequence's anchors in several passes give the one pass's step."""

import copy

import torch
from transformers import Qwen3Config

from dflash_core.config import config_from_dict
from dflash_core.data import Batch
from dflash_core.models import objective as obj
from dflash_core.models.dflash.drafter import DFlashDrafter, build_drafter_config
from dflash_core.models.training.replica import ANCHOR_PAD, prepare_batch
from dflash_core.models.training.trainer import make_replicas, reduce_and_step


def _long_sample_step(recompute: bool, S: int = 16384, A: int = 128):
    """Forward + backward of one long sample through a small drafter on cuda:0 under bf16
    autocast: (loss, gradients, peak bytes over what was allocated before)."""
    gpu = torch.device("cuda", 0)
    tc = Qwen3Config(vocab_size=1000, hidden_size=256, intermediate_size=512,
                     num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2,
                     head_dim=64)
    torch.manual_seed(0)
    d = DFlashDrafter(build_drafter_config(tc, num_layers=4, target_layer_ids=[1, 3, 5],
                                           block_size=16, mask_token_id=999)).to(gpu).train()
    d.recompute = recompute
    g = torch.Generator(device=gpu).manual_seed(1)
    ctx = torch.randn(1, S, 3 * 256, device=gpu, generator=g, dtype=torch.bfloat16)
    anchors = torch.sort(torch.randperm(S - 20, device=gpu, generator=g)[:A] + 10).values[None]
    ids = torch.randint(0, 999, (1, S), device=gpu, generator=g)
    labels = obj.block_labels(ids, torch.ones_like(ids), anchors, 16)
    emb = torch.randn(1, A * 16, 256, device=gpu, generator=g)
    pos = (anchors[:, :, None] + torch.arange(16, device=gpu)).view(1, -1)
    head = torch.randn(1000, 256, device=gpu, generator=g, dtype=torch.bfloat16) * 0.05
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats(gpu)
    before = torch.cuda.memory_allocated(gpu)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        hidden = d(ctx, emb, pos, anchors)
    loss = obj.chunked_loss(hidden, labels, head, 7.0, 1024).loss
    loss.backward()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated(gpu) - before
    return loss.item(), {n: p.grad for n, p in d.named_parameters()}, peak


def test_recomputed_layers_give_the_kept_layers_step_and_hold_less():
    # The process's one compiled FlexAttention has compiled the earlier tests' shapes; past
    # dynamo's recompile limit it runs eagerly (the full score matrix), which is what a run of
    # one drafter never sees. Start its cache afresh, as a run's process does.
    torch._dynamo.reset()
    kept_loss, kept, kept_peak = _long_sample_step(False)
    loss, again, peak = _long_sample_step(True)
    assert loss == kept_loss
    for name, g in kept.items():
        assert torch.allclose(again[name], g, rtol=1e-4, atol=1e-6), name
    assert peak < 0.6 * kept_peak, (peak, kept_peak)


def test_anchor_passes_on_the_gpu_step_as_one_pass():
    """One sample of 2048 tokens with 256 anchors: in one pass, and in four of ANCHOR_PAD."""
    gpu = torch.device("cuda", 0)
    tc = Qwen3Config(vocab_size=1000, hidden_size=128, intermediate_size=256,
                     num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2,
                     head_dim=32)
    cfg = config_from_dict({"drafter": {"objective": "dflash", "num_layers": 2, "block_size": 8,
                                        "num_anchors": 256, "loss_chunk": 512}})
    torch.manual_seed(0)
    init = DFlashDrafter(build_drafter_config(tc, num_layers=2, target_layer_ids=[1, 3, 5],
                                              block_size=8, mask_token_id=999))
    g = torch.Generator().manual_seed(2)
    S = 2048
    ids = torch.randint(0, 999, (1, S), generator=g)
    mask = torch.ones(1, S, dtype=torch.long)
    batch = prepare_batch(Batch(input_ids=ids, loss_mask=mask, attention_mask=mask,
                                lengths=torch.tensor([S]), indices=[0], epoch=0,
                                batch_index=0, num_tokens=S, padded_tokens=S,
                                padding_frac=0.0), 256, 8, seed=0, pad_to=ANCHOR_PAD)
    assert batch.anchors.shape == (1, 256)
    feats = torch.randn(1, S, 3 * 128, generator=g).to(gpu, torch.bfloat16)
    embed = torch.nn.Embedding(1000, 128).to(gpu, torch.bfloat16)
    head = torch.nn.Linear(128, 1000, bias=False).to(gpu, torch.bfloat16)
    results = []
    for micro in (256 * 8, ANCHOR_PAD * 8):
        d = copy.deepcopy(cfg.drafter)
        d.micro_block_tokens = micro
        (rep,) = make_replicas(copy.deepcopy(init), [gpu], d, cfg.optim, copy.deepcopy(embed),
                               copy.deepcopy(head))
        calls = []
        real = rep.drafter.forward
        rep.drafter.forward = lambda *a, **k: calls.append(a[3].shape[1]) or real(*a, **k)
        rep.accumulate(batch, feats, seed=0)
        grads = rep.grads.clone()
        results.append((reduce_and_step([rep], 0, 10), grads, calls))
    (one, g_one, c_one), (split, g_split, c_split) = results
    assert c_one == [256] and c_split == [ANCHOR_PAD] * 4
    assert abs(split.loss - one.loss) <= 1e-3 * abs(one.loss)
    assert split.tau_tf == one.tau_tf
    # bf16 sums in another order: the gradient as a whole, not each (near-zero) element
    diff = float((g_split.double() - g_one.double()).norm() / g_one.double().norm())
    assert diff < 1e-2, diff
