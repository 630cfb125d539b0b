"""The evaluation's prompts end at a turn boundary of the data (where a trained span begins),
never inside a user's turn; (c)'s held-out samples start their scored part at the same place."""

import numpy as np

from dflash_core.pipeline.evaluation import eval_prompts, heldout_samples


class Samples:
    def __init__(self, masks):
        self.rows = [(np.arange(len(m)), np.asarray(m, np.uint8)) for m in masks]

    def get(self, i):
        return self.rows[i]


def mask(*runs):
    """(value, length) runs -> a loss mask."""
    return [v for v, n in runs for _ in range(n)]


def test_a_prompt_longer_than_prompt_tokens_is_kept_whole_to_its_turn_boundary():
    ds = Samples([mask((0, 60), (1, 30))])  # a chat sample: 60 tokens of prompt
    [p] = eval_prompts(ds, [0], prompt_tokens=48)
    assert p == list(range(60))  # not cut at 48, inside the user's turn
    [(ids, m)] = heldout_samples(ds, [0], 48, new_tokens=8, max_length=1000)
    assert len(ids) == 68 and m[60:].all() and not m[:60].any()


def test_the_last_turn_boundary_within_prompt_tokens_is_taken():
    ds = Samples([mask((0, 20), (1, 10), (0, 40), (1, 10))])  # two turns: boundaries 20, 70
    assert [len(p) for p in eval_prompts(ds, [0], 64)] == [20]
    assert [len(p) for p in eval_prompts(ds, [0], 80)] == [70]
    assert [len(p) for p in eval_prompts(ds, [0], 70)] == [70]


def test_a_sample_without_a_boundary_is_cut_at_prompt_tokens():
    ds = Samples([mask((1, 90)), mask((0, 30)), mask((1, 50), (0, 5), (1, 5))])
    assert [len(p) for p in eval_prompts(ds, [0, 1, 2], 48)] == [48, 29, 55]
