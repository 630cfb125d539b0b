"""Batch plans, the held-out split, collation, and the resumable batch stream."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dflash_core.data import DataError, collate, padding_fraction, plan_epoch, split_eval
from dflash_core.data.batching import RUN_STEPS, drafter_cost

from tests.core.data.samples import make_stream


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_plan_respects_budget_and_covers_every_sample_once(seed):
    rng = np.random.default_rng(seed)
    n = 3000
    lengths = rng.integers(0, 900, n)
    lengths[rng.choice(n, 50)] = rng.integers(0, 2, 50)  # too short: skipped
    budget, max_seqs, max_length = int(rng.integers(512, 3000)), int(rng.integers(1, 40)), 512
    kw = dict(token_budget=budget, max_seqs=max_seqs, max_length=max_length, seed=seed,
              window=int(rng.integers(50, 1000)))
    plan = plan_epoch(lengths, epoch=0, **kw)
    eff = np.minimum(lengths, max_length)
    for b in plan:
        assert 1 <= len(b) <= max_seqs
        assert len(b) * eff[b].max() <= budget
    flat = [i for b in plan for i in b]
    assert sorted(flat) == np.flatnonzero(eff >= 2).tolist()  # each eligible sample exactly once

    assert plan_epoch(lengths, epoch=0, **kw) == plan  # deterministic
    assert plan_epoch(lengths, epoch=1, **kw) != plan  # reshuffled each epoch

    world = 3
    parts = [plan_epoch(lengths, epoch=0, shard=(r, world), **kw) for r in range(world)]
    assert all(parts) and sorted(i for p in parts for b in p for i in b) == sorted(flat)
    assert parts[1] == plan[1::world]


def test_plan_buckets_lengths_and_reports_padding():
    lengths = np.random.default_rng(0).integers(2, 2000, 5000)
    kw = dict(token_budget=8192, max_seqs=64, max_length=2048, seed=0, epoch=0)
    bucketed = plan_epoch(lengths, window=5000, **kw)
    # the same batch sizes filled at random, without sorting by length
    perm = np.random.default_rng(1).permutation(len(lengths)).tolist()
    cuts = np.cumsum([0] + [len(b) for b in bucketed])
    unsorted = [perm[a:b] for a, b in zip(cuts[:-1], cuts[1:])]
    pb = padding_fraction(bucketed, lengths, 2048)
    pu = padding_fraction(unsorted, lengths, 2048)
    assert 0 <= pb < 0.05 and pu > 0.3
    b = bucketed[0]
    manual = 1 - lengths[b].sum() / (len(b) * lengths[b].max())
    assert padding_fraction([b], lengths, 2048) == pytest.approx(manual)
    with pytest.raises(ValueError):
        plan_epoch(lengths, token_budget=100, max_seqs=4, max_length=200, seed=0, epoch=0)


def _step_costs(plan, lengths, group, anchors=512, max_length=3072):
    """Per optimizer step of ``group`` consecutive batches: (its dearest batch, their mean)."""
    cost = np.array([drafter_cost(len(b), int(max(lengths[b])), max_length, anchors)
                     for b in plan], float)
    m = len(cost) // group * group
    steps = cost[:m].reshape(-1, group)
    return steps.max(1), steps.mean(1)


@pytest.mark.parametrize("group", [2, 6])
def test_balanced_order_gives_each_step_batches_of_like_cost(group):
    """Data-parallel drafters wait for the step's dearest batch: the share of drafter time spent
    working (sum of means / sum of maxima) rises from ~0.75-0.86 to >= 0.93; the batches are the
    same, only their order changes, deterministically per (seed, epoch)."""
    rng = np.random.default_rng(0)
    lengths = np.clip(rng.lognormal(6.8, 0.7, 20000), 256, 3072).astype(int)  # chat-like
    kw = dict(token_budget=65536, max_seqs=64, max_length=3072, seed=3, epoch=1)
    plain = plan_epoch(lengths, **kw)
    balanced = plan_epoch(lengths, balance=group, anchors=512, **kw)
    assert sorted(map(tuple, balanced)) == sorted(map(tuple, plain))
    assert balanced == plan_epoch(lengths, balance=group, anchors=512, **kw)
    assert balanced != plan_epoch(lengths, balance=group, anchors=512, **{**kw, "epoch": 2})
    hi, mean = _step_costs(plain, lengths, group)
    plain_eff = mean.sum() / hi.sum()
    hi, mean = _step_costs(balanced, lengths, group)
    eff = mean.sum() / hi.sum()
    assert plain_eff < 0.9 and eff >= 0.93, (plain_eff, eff)
    # Still shuffled: the runs come in random order, not cheapest first.
    costs = [drafter_cost(len(b), int(max(lengths[b])), 3072, 512) for b in balanced]
    run = RUN_STEPS * group
    firsts = [costs[i] for i in range(0, len(costs) - run, run)]
    assert firsts != sorted(firsts) and firsts != sorted(firsts, reverse=True)
    # One drafter: the plan is the unbalanced one, as before this option existed.
    assert plan_epoch(lengths, balance=1, anchors=512, **kw) == plain


def test_drafter_cost_counts_rows_times_capped_anchors_weighted_by_context():
    from dflash_core.data.batching import CONTEXT_SCALE

    ctx = lambda n: 1 + n / CONTEXT_SCALE  # noqa: E731
    assert drafter_cost(64, 300, 3072, 512) == pytest.approx(64 * 300 * ctx(300))  # all anchors
    assert drafter_cost(21, 3072, 3072, 512) == pytest.approx(21 * 512 * ctx(3072))  # capped
    assert drafter_cost(5, 4000, 3072, 0) == pytest.approx(5 * 3072 * ctx(3072))  # truncated
    # Measured on an H200 (8B-shaped drafter, 16384-token batches): 64 x 256 took 4.03 s a
    # step and 5 x 3072 took 0.95 s; the cost's ratio is within 10% of the times'.
    ratio = drafter_cost(64, 256, 3072, 512) / drafter_cost(5, 3072, 3072, 512)
    assert ratio == pytest.approx(4.03 / 0.95, rel=0.1)


def test_split_eval():
    train, ev = split_eval(100, 8, seed=3)
    assert len(ev) == 8 and len(train) == 92
    assert sorted(np.concatenate([train, ev]).tolist()) == list(range(100))
    again = split_eval(100, 8, seed=3)
    assert np.array_equal(again[1], ev) and np.array_equal(again[0], train)
    assert not np.array_equal(split_eval(100, 8, seed=4)[1], ev)
    assert len(split_eval(10, 0, seed=0)[0]) == 10
    lengths = np.arange(100)
    _, ev = split_eval(100, 5, seed=0, lengths=lengths, min_length=90)
    assert (ev >= 90).all()
    with pytest.raises(DataError):
        split_eval(10, 10, seed=0)


def test_collate_pads_truncates_and_counts(dataset):
    idx = [3, 10, 42]
    b = collate(dataset, idx, max_length=50, epoch=2, batch_index=7)
    lens = [min(len(dataset.get(i)[0]), 50) for i in idx]
    width = max(lens)
    assert b.input_ids.shape == b.loss_mask.shape == b.attention_mask.shape == (3, width)
    assert b.input_ids.dtype == torch.long
    for r, i in enumerate(idx):
        ids, mask = dataset.get(i)
        k = lens[r]
        assert b.input_ids[r, :k].tolist() == ids[:k].tolist()
        assert b.loss_mask[r, :k].tolist() == mask[:k].tolist()
        assert b.input_ids[r, k:].eq(0).all() and b.loss_mask[r, k:].eq(0).all()
        assert b.attention_mask[r].sum().item() == k
    assert b.lengths.tolist() == lens and b.indices == idx
    assert (b.epoch, b.batch_index, b.num_tokens, b.padded_tokens) == (2, 7, sum(lens), 3 * width)
    assert b.padding_frac == pytest.approx(1 - sum(lens) / (3 * width))
    pinned = b.pin()
    assert torch.equal(pinned.input_ids, b.input_ids)
    if not torch.cuda.is_available():
        assert pinned is b


def test_stream_epochs_workers_and_exclude(dataset):
    exclude = {0, 1, 2, 399}
    stream = make_stream(dataset, exclude=exclude)
    eligible = {i for i in range(len(dataset)) if dataset.lengths[i] >= 2} - exclude
    for world in (1, 3):
        for epoch in range(3):
            seen = []
            for rank in range(world):
                for b in stream.iter_batches(epoch, worker=(rank, world)):
                    if b.epoch != epoch:
                        break
                    assert b.batch_index % world == rank
                    assert b.indices == stream.plan(epoch)[b.batch_index]
                    assert b.num_tokens <= b.padded_tokens <= 600 and len(b) <= 8
                    seen += b.indices
            assert sorted(seen) == sorted(eligible)  # union over workers: everything, once
    assert stream.batches_per_epoch == len(stream.plan(0))
    assert stream.total_batches() == sum(len(stream.plan(e)) for e in range(3))
    assert 0 <= stream.padding_frac() < 1


def test_resume_yields_exactly_the_remaining_batches(dataset):
    stream = make_stream(dataset)
    full = [(b.epoch, b.batch_index, b.indices) for b in stream.iter_batches(0)]
    assert [e for e, _, _ in full].count(0) == stream.batches_per_epoch
    # trained so far in epoch 1: an arbitrary subset (several workers finish out of order)
    n1 = len(stream.plan(1))
    done = set(np.random.default_rng(0).choice(n1, n1 // 2, replace=False).tolist())
    # a fresh stream (a restarted process) must plan the same epochs
    resumed = [(b.epoch, b.batch_index, b.indices)
               for b in make_stream(dataset).iter_batches(1, done=done)]
    expected = [x for x in full if x[0] >= 1 and not (x[0] == 1 and x[1] in done)]
    assert resumed == expected


def test_positions_are_a_nodes_batches_merged_in_plan_order(dataset):
    """The hs queue's order: what targets 2 and 3 of 6 take (node 1 of 3, two targets each),
    resumed mid-epoch, is exactly the union of their iter_batches, sorted by plan position."""
    stream = make_stream(dataset)
    done = set(range(0, len(stream.plan(1)), 5))
    taken = [(b.epoch, b.batch_index) for r in (2, 3)
             for b in stream.iter_batches(1, done=done, worker=(r, 6))]
    assert list(stream.positions(1, done, range(2, 4), 6)) == sorted(taken)
    assert len(taken) > 10


def test_a_stream_planned_for_another_layout_takes_the_checkpoints_order(dataset):
    """A resumed run's "done" batch indices refer to the order its checkpoint was written with:
    use_balance restores that order whatever the new layout would balance for."""
    written = make_stream(dataset, balance=4, anchors=8)
    now = make_stream(dataset, balance=2, anchors=8)
    assert now.plan(0) != written.plan(0)
    assert sorted(map(tuple, now.plan(0))) == sorted(map(tuple, written.plan(0)))
    now.use_balance(4)
    assert now.plan(0) == written.plan(0) and now.balance == 4
