"""How many anchors a sample gets (anchor_counts.py): a count, or a density that follows its
length; and how many of a sequence's anchors one drafter pass takes."""

import numpy as np
import pytest
import torch

from dflash_core.anchor_counts import ANCHOR_PAD, anchors_for, pass_anchors
from dflash_core.data.batching import drafter_cost
from dflash_core.models import objective as obj


def test_a_count_supervises_long_answers_thinly_and_a_density_alike():
    # 512 each: a 2k answer at 25% of its positions, a 100k one at 0.5%
    assert anchors_for(2048, 512) == 512 and anchors_for(102_400, 512) == 512
    assert anchors_for(300, 512) == 300  # all of them when it has fewer
    # 64 per 1k tokens, capped at 8192: both at 6.4%
    short, long_ = anchors_for(2000, 8192, 64), anchors_for(100_000, 8192, 64)
    assert (short, long_) == (128, 6400)
    assert short / 2000 == long_ / 100_000
    assert anchors_for(200_000, 8192, 64) == 8192  # the count caps the longest
    assert anchors_for(3, 512, 64) == 1  # at least one
    assert anchors_for(0, 512, 64) == 0  # none without a trainable position
    assert anchors_for(10, 512, 5000) == 10  # never more than its positions


def test_density_anchors_are_drawn_in_proportion_to_each_samples_length():
    rng = lambda i: obj.anchor_rng(0, 0, i)  # noqa: E731
    masks = [np.ones(n, dtype=np.int64) for n in (1001, 4001, 16001)]  # 1000, 4000, 16000 valid
    counts = [len(obj.sample_anchors(m, 100_000, rng(i), per_1k=32))
              for i, m in enumerate(masks)]
    assert counts == [32, 128, 512]
    # a count: each gets the same, the long ones thinly
    assert [len(obj.sample_anchors(m, 512, rng(i))) for i, m in enumerate(masks)] == [
        512, 512, 512]
    # the count's draw is the one it always was (same generator, same call): resumes agree
    m = masks[1]
    old = np.sort(rng(1).choice(obj.valid_anchor_positions(m), size=512, replace=False))
    assert np.array_equal(obj.sample_anchors(m, 512, rng(1)), old)
    a = obj.batch_anchors(masks, 100_000, 0, 0, [0, 1, 2], pad_to=64, per_1k=32)
    assert a.shape == (3, 512)
    assert [(r >= 0).sum().item() for r in a] == [32, 128, 512]
    assert torch.all(a[0, 32:] == -1)


def test_a_batches_drafter_cost_follows_the_density():
    # rows x anchors of the longest: a count caps long rows, a density does not
    assert drafter_cost(1, 65536, 131072, 512) == pytest.approx(512 * (1 + 65536 / 5800))
    dense = drafter_cost(1, 65536, 131072, 100_000, per_1k=16)
    assert dense == pytest.approx(1049 * (1 + 65536 / 5800))
    assert drafter_cost(4, 2000, 131072, 100_000, per_1k=16) == pytest.approx(
        4 * 32 * (1 + 2000 / 5800))


def test_a_pass_takes_the_anchors_that_fit_padded_for_compiled_attention():
    assert pass_anchors(8192, 512, 16) == 512  # one sequence fits a pass
    assert pass_anchors(8192, 2048, 16, ANCHOR_PAD) == 512
    assert pass_anchors(8000, 2048, 16, ANCHOR_PAD) == 448  # 500 blocks, rounded down to 64s
    assert pass_anchors(100, 2048, 16, ANCHOR_PAD) == ANCHOR_PAD  # never below the pad
    assert pass_anchors(100, 40, 16, ANCHOR_PAD) == 40  # under a pad's worth: all of them
    assert pass_anchors(100, 40, 16, 1) == 6  # on the CPU (pad 1): the 6 blocks that fit
    assert pass_anchors(8, 40, 16, 1) == 1
