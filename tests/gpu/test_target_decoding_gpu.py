"""Decoding with the target's cache on the GPU (flash-linear-attention's kernels for the hybrid
target, the cache copied on the device) decodes what full forwards decode."""

import pytest
import torch

from dflash_core.eval.evaluate import plain_greedy, speculative_generate, target_fn_for
from dflash_core.models.target.model import TargetModel
from tests.core.eval.test_target_decoding import (
    BLOCK, LAYERS, MAX_NEW, PROMPTS, Recording, _qwen3, _qwen35,
)


@pytest.mark.parametrize("build", [_qwen3, _qwen35], ids=["qwen3", "qwen3_5"])
def test_cached_decoding_equals_full_forwards_on_the_gpu(build):
    target = TargetModel(build().cuda())  # float32: no near ties between the two ways
    full_fn, cached_fn = target_fn_for(target, LAYERS), target_fn_for(target, LAYERS, cache=True)
    for prompt in PROMPTS:
        truth = list(prompt) + plain_greedy(full_fn, prompt, MAX_NEW + BLOCK, device="cuda")
        full = speculative_generate(full_fn, Recording(_Cuda(BLOCK), truth), prompt, MAX_NEW,
                                    device="cuda")
        cached = speculative_generate(cached_fn, Recording(_Cuda(BLOCK), truth), prompt, MAX_NEW)
        assert cached.tokens == full.tokens == truth[len(prompt):len(prompt) + MAX_NEW]
        assert cached.acceptance == full.acceptance
        assert any(0 < a < BLOCK - 1 for a in cached.acceptance)  # rewinds were exercised


class _Cuda:
    """What Recording wraps when it proposes the truth: a block size and a device."""

    def __init__(self, block_size):
        self.block_size, self.target_layer_ids = block_size, LAYERS

    def parameters(self):
        return iter([torch.empty(0, device="cuda")])
