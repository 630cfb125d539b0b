"""Tiny DFlash2 drafters for the tests of models/dflash2 (random weights, CPU, seconds)."""

import torch
from transformers import Qwen3Config

from dflash_core.families.dflash2 import DFlash2Settings
from dflash_core.models.dflash.drafter import DFlashDrafter, build_drafter_config
from dflash_core.models.dflash2.drafter import DFlash2Drafter

V, H, B, R, K, LAYER_IDS = 300, 64, 6, 8, 5, [1, 3, 5]
SETTINGS = DFlash2Settings(block_size=B, conv_kernel_size=2, conv_group_size=16,
                           selector_rank=R, selector_top_k=K)


def target_config():
    return Qwen3Config(vocab_size=V, hidden_size=H, intermediate_size=128, num_hidden_layers=8,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16)


def dflash(seed=0, layers=2, block=B):
    cfg = build_drafter_config(target_config(), num_layers=layers, target_layer_ids=LAYER_IDS,
                               block_size=block, mask_token_id=V - 1)
    torch.manual_seed(seed)
    return DFlashDrafter(cfg).eval()


def dflash2(seed=0, layers=2, settings=SETTINGS, std=None):
    """A fresh DFlash2 drafter; ``std``: every weight redrawn N(0, std^2) (the convolutions and
    the selector away from their start, so a wrong index or side shows)."""
    cfg = DFlash2Drafter.new_config(target_config(), num_layers=layers,
                                    target_layer_ids=LAYER_IDS, block_size=settings.block_size,
                                    mask_token_id=V - 1, settings=settings)
    torch.manual_seed(seed)
    m = DFlash2Drafter(cfg).eval()
    if std is not None:
        with torch.no_grad():
            for name, p in m.named_parameters():
                if name.endswith("base_kernel"):
                    p.normal_(0.5, std)
                elif "norm" in name:
                    p.normal_(1.0, std)
                else:
                    p.normal_(0, std)
    return m


def head(seed=7, vocab=V):
    """A target's embedding and lm_head (random)."""
    g = torch.Generator().manual_seed(seed)
    emb = torch.nn.Embedding(vocab, H)
    lm = torch.nn.Linear(H, vocab, bias=False)
    with torch.no_grad():
        emb.weight.copy_(torch.randn(vocab, H, generator=g))
        lm.weight.copy_(torch.randn(vocab, H, generator=g) * 0.3)
    return emb, lm
