"""vLLM's share of a real card under --engine vllm (eval/served_memory.vllm_memory): what is
free less a margin, measured after this engine gives its own memory back; what another holder
keeps is not asked for. No vLLM needed (the share is decided before vLLM starts)."""

import pytest
import torch

from dflash_core.eval import served_memory
from dflash_core.eval.errors import EvalInputError


def test_the_share_follows_what_is_free_and_our_memory_given_back_counts():
    dev = torch.device("cuda", 0)
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(dev)
    said: list[str] = []
    before = served_memory.vllm_memory(dev, None, said.append).share
    assert 0 < before <= served_memory.GPU_SHARE_MAX
    assert before * total <= free - (1 << 30) + total * 0.01  # within the floor's hundredth
    # a holder of a third of the card (as our own target would be, until released)
    held = torch.empty(int(total / 3), dtype=torch.uint8, device=dev)
    free_held, _ = torch.cuda.mem_get_info(dev)
    during = served_memory.vllm_memory(dev, None, said.append).share
    gib = 1 << 30
    cap = served_memory.GPU_SHARE_MAX
    # what is free while it holds, less the margin, at most the cap
    assert during == pytest.approx(
        min(cap, served_memory.share_that_fits(free_held / gib, total / gib)), abs=0.01)
    # The held third comes off what fits, but `before` was capped at 0.9 first: on an idle
    # H100 80 GB what fits is about 0.97, capped to 0.9, so the share drops by about 0.26, not a
    # third. The expected drop is the capped share before less the capped share after, each
    # from what was free (a hundredth each way for the floors).
    fits_before = served_memory.share_that_fits(free / gib, total / gib)
    fits_during = fits_before - (free - free_held) / total
    expected_drop = min(cap, fits_before) - min(cap, fits_during)
    assert before - during == pytest.approx(expected_drop, abs=0.02)
    assert free - free_held >= total / 3 - (64 << 20)  # the third is really held (allocator slack)
    del held
    torch.cuda.empty_cache()  # what Evaluation.release does before vLLM starts
    again = served_memory.vllm_memory(dev, None, said.append).share
    assert again == pytest.approx(before, abs=0.02)
    assert said[-1].startswith("vLLM gets ") and "--vllm-memory sets it" in said[-1]


def test_a_card_held_almost_whole_by_another_is_refused_before_vllm_starts():
    dev = torch.device("cuda", 0)
    torch.cuda.empty_cache()
    free, _ = torch.cuda.mem_get_info(dev)
    held = torch.empty(max(0, free - (1 << 30)), dtype=torch.uint8, device=dev)
    try:
        with pytest.raises(EvalInputError) as err:
            served_memory.vllm_memory(dev, None, lambda m: None)
        assert "too little for vLLM" in str(err.value) and "nvidia-smi" in err.value.hint
    finally:
        del held
        torch.cuda.empty_cache()
