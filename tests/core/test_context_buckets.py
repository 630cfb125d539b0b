"""Acceptance by context length (context_buckets.py): the buckets follow the target's window, a
round at an edge opens the next bucket, the counts and taus per bucket, and the words every
reader shows (only when more than one bucket has rounds)."""

import pytest

from dflash_core.context_buckets import (
    DEFAULT_EDGES, Buckets, ContextCounts, buckets_of, by_context, context_line, context_wandb,
    edges_for, round_positions, shown,
)


@pytest.mark.parametrize("window, edges, labels", [
    (None, DEFAULT_EDGES, ["0-1k", "1-4k", "4-16k", "16-64k", "64k+"]),
    (262144, DEFAULT_EDGES, ["0-1k", "1-4k", "4-16k", "16-64k", "64-256k"]),
    (40960, (1024, 4096, 16384), ["0-1k", "1-4k", "4-16k", "16-40k"]),  # Qwen3-8B's window
    (8192, (1024, 4096), ["0-1k", "1-4k", "4-8k"]),
    # fewer than two defaults fit: all halved until two do
    (4096, (512, 2048), ["0-512", "512-2k", "2-4k"]),
    (1024, (128, 512), ["0-128", "128-512", "512-1k"]),  # the demo's target
    (512, (64, 256), ["0-64", "64-256", "256-512"]),
])
def test_the_buckets_follow_the_window(window, edges, labels):
    b = Buckets.of(window)
    assert edges_for(window) == edges == b.edges
    assert [b.label(j) for j in range(len(b))] == labels
    assert b.bounds(len(b) - 1)[1] == window  # the last bucket ends at the window


def test_a_tiny_window_still_ends():
    assert edges_for(3) == (1,) and Buckets.of(3).label(1) == "1-3"


def test_a_round_at_an_edge_opens_the_next_bucket():
    b = Buckets.of(40960)
    assert [b.index(p) for p in (0, 1023, 1024, 4095, 4096, 16383, 16384, 40960)] == [
        0, 0, 1, 1, 2, 2, 3, 3]


def test_a_rounds_position_is_the_prompt_and_the_tokens_before_it():
    # the prefill's token, then per round its accepted drafts and the target's own
    assert round_positions(10, [2, 0, 1]) == [11, 14, 15]
    assert round_positions(5, []) == []


def test_counts_and_tau_per_bucket():
    b = Buckets((16,), None)
    recs = by_context(b, [([11, 14, 16], [2, 1, 3]), ([20], [0])])
    assert [(r["bucket"], r["from"], r["to"]) for r in recs] == [("0-16", 0, 16),
                                                                  ("16+", 16, None)]
    assert [(r["rounds"], r["accepted"]) for r in recs] == [(2, 3), (2, 3)]
    assert [r["tau"] for r in recs] == [pytest.approx(2.5), pytest.approx(2.5)]
    empty = ContextCounts(b).add([3], [1]).records()
    assert empty[1]["rounds"] == 0 and empty[1]["tau"] is None  # no round: no tau
    with pytest.raises(ValueError, match="2 positions for 1 rounds"):
        ContextCounts(b).add([1, 2], [0])


def test_shown_only_with_rounds_in_more_than_one_bucket():
    b = Buckets.of(40960)
    one = by_context(b, [([100, 200], [1, 2])])
    two = by_context(b, [([100, 5000], [1, 2])])
    assert not shown(one) and context_line(one) == "" and not shown([]) and not shown(None)
    assert shown(two)
    assert context_line(two) == "tau by context 0-1k 2.00 (1) | 4-16k 3.00 (1)"
    assert context_wandb(two) == {"eval/tau_by_context/0-1k": 2.0,
                                  "eval/rounds_by_context/0-1k": 1,
                                  "eval/tau_by_context/4-16k": 3.0,
                                  "eval/rounds_by_context/4-16k": 1}
    assert set(context_wandb(two, "eval/long/")) == {
        "eval/long/tau_by_context/0-1k", "eval/long/rounds_by_context/0-1k",
        "eval/long/tau_by_context/4-16k", "eval/long/rounds_by_context/4-16k"}


def test_a_targets_window_is_its_text_configs():
    class Text:
        max_position_embeddings = 1024

    class Target:
        text_config = Text()

    assert buckets_of(Target()).edges == (128, 512)
    assert buckets_of(object()).edges == DEFAULT_EDGES  # a stub without a config
