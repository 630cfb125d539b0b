"""Data/target agreement: counted right against the full logits, and never more than asked for."""

import copy

import pytest
import torch

from dflash_core.models.agreement import (
    dataset_agreement,
    greedy_at,
    label_agreement,
    sample_positions,
)
from dflash_core.eval.evaluate import hf_target_fn, plain_greedy
from dflash_core.models.target.model import TargetModel

from tests.core.eval.test_evaluate import VOCAB, one_thread, tiny_qwen3  # noqa: F401 - one_thread: a fixture


@pytest.fixture(scope="module")
def model():
    return tiny_qwen3(3)


def _full_count(model, ids, mask):
    """The same count the slow way: full logits, every trained position."""
    with torch.no_grad():
        pred = model(input_ids=ids[None]).logits[0].argmax(-1)
    t = torch.nonzero(mask[1:] > 0).flatten() + 1
    return int((pred[t - 1] == ids[t]).sum()), len(t)


def _own_text(model, prompt, n):
    fn = hf_target_fn(model, [0])
    return torch.tensor(prompt + plain_greedy(fn, prompt, n))


def test_chunked_argmax_equals_full_argmax(model):
    torch.manual_seed(3)
    h = torch.randn(33, 48)
    full = model.lm_head(h).argmax(-1)
    for chunk in (1, 10, 64, VOCAB, 1000):
        assert torch.equal(greedy_at(h, model.lm_head, chunk), full), chunk


def test_ties_go_to_the_lowest_id_across_chunks():
    head = torch.nn.Linear(2, 6, bias=False)
    with torch.no_grad():
        head.weight.copy_(torch.tensor([[0., 0], [1, 0], [0, 0], [1, 0], [1, 0], [0, 0]]))
    assert greedy_at(torch.tensor([[1.0, 0.0]]), head, chunk=2).tolist() == [1]


def test_the_targets_own_continuation_agrees_fully(model):
    ids = _own_text(model, [5, 17, 3, 40], 30)
    mask = torch.tensor([0] * 4 + [1] * 30)
    agree, total = label_agreement(model, ids, mask, chunk=16)
    assert (agree, total) == (30, 30)


def test_other_text_counts_as_the_full_logits_do(model):
    torch.manual_seed(5)
    ids = torch.randint(0, VOCAB, (60,))
    mask = torch.tensor([0] * 10 + [1] * 50)
    got = label_agreement(model, ids, mask, chunk=7)
    assert got == _full_count(model, ids, mask)
    assert got[0] < got[1] // 2  # random labels: mostly not the target's choice


def test_a_mixed_response_is_counted_token_by_token(model):
    own = _own_text(model, [9, 8, 7], 20)
    ids = own.clone()
    ids[13:23:3] = (ids[13:23:3] + 1) % VOCAB  # 4 labels that are not the target's choice
    mask = torch.tensor([0] * 3 + [1] * 20)
    # A changed token also changes what the target predicts after it: count with full logits.
    assert label_agreement(model, ids, mask) == _full_count(model, ids, mask)
    assert label_agreement(model, ids, mask)[0] <= 20 - 4


def test_batch_and_list_of_rows_agree_with_rows_alone(model):
    torch.manual_seed(7)
    a = torch.randint(0, VOCAB, (40,))
    b = _own_text(model, [1, 2], 18)  # 20 tokens
    mask_a = torch.tensor([0] * 5 + [1] * 35)
    mask_b = torch.tensor([0] * 2 + [1] * 18)
    one = [label_agreement(model, a, mask_a), label_agreement(model, b, mask_b)]
    want = (one[0][0] + one[1][0], one[0][1] + one[1][1])
    assert label_agreement(model, [a.tolist(), b.tolist()], [mask_a.tolist(), mask_b.tolist()]
                           ) == want
    pad_b = torch.cat([b, torch.zeros(20, dtype=torch.long)])
    pad_m = torch.cat([mask_b, torch.zeros(20, dtype=torch.long)])
    assert label_agreement(model, torch.stack([a, pad_b]), torch.stack([mask_a, pad_m])) == want


def test_max_positions_caps_the_sample_and_is_deterministic(model):
    torch.manual_seed(9)
    ids = torch.randint(0, VOCAB, (80,))
    mask = torch.ones(80, dtype=torch.long)
    first = label_agreement(model, ids, mask, max_positions=12)
    assert first[1] == 12
    assert label_agreement(model, ids, mask, max_positions=12) == first
    picked = sample_positions([mask], 12)
    assert len(set(picked)) == 12 and all(1 <= t < 80 for _, t in picked)
    # position 0 has nothing before it to predict it from: never sampled
    assert sample_positions([torch.ones(1)], 5) == []


def test_works_on_a_target_model(model):
    target = TargetModel(copy.deepcopy(model))
    torch.manual_seed(11)
    ids = torch.randint(0, VOCAB, (30,))
    mask = torch.tensor([0] * 6 + [1] * 24)
    assert label_agreement(target, ids, mask) == label_agreement(model, ids, mask)


def test_dataset_agreement_over_indices(model):
    own = _own_text(model, [4, 4], 14)

    class Data:
        rows = [(own.numpy(), torch.tensor([0, 0] + [1] * 14).numpy()),
                (torch.arange(16).numpy() % VOCAB, torch.ones(16, dtype=torch.long).numpy())]

        def get(self, i):
            return self.rows[i]

    res = dataset_agreement(model, Data(), [0])
    assert (res.agree, res.total, res.share) == (14, 14, 1.0)
    both = dataset_agreement(model, Data(), [0, 1])
    assert both.total == 14 + 15 and both.agree < both.total
    assert dataset_agreement(model, Data(), []).total == 0


def test_mismatched_shapes_are_refused(model):
    with pytest.raises(ValueError, match="same shape"):
        label_agreement(model, torch.zeros(5, dtype=torch.long), torch.ones(4))
