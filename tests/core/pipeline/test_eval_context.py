"""The run's evaluation counts acceptance by context length (context_buckets.py) in the buckets
of the target's window: each prompt set's EvalResult carries them (a long prompt's rounds in a
later bucket than a short one's), and so does the held-out decoding's summary."""

from __future__ import annotations

import pytest
import torch

from dflash_core.config import EvalConfig
from dflash_core.context_buckets import Buckets
from dflash_core.eval.evaluate import evaluate_tau, target_fn_for
from dflash_core.eval.run_sets import RunSet
from dflash_core.pipeline.evaluation import Evaluator
from tests.core.eval.conftest import DEMO_LAYERS, DEMO_TEXTS

NEW = 6


@pytest.fixture(autouse=True)
def one_thread():
    """One intra-op thread: tiny matrices on a busy machine (no spinning)."""
    from dflash_core.demo import torch_threads

    with torch_threads(1):
        yield


@pytest.fixture(scope="module")
def models(demo_target):
    from dflash_core.demo import torch_threads
    from dflash_core.models.dflash.drafter import DFlashDrafter, build_drafter_config
    from dflash_core.models.target.load import load_target

    with torch_threads(1):
        target = load_target(demo_target, device=torch.device("cpu"), dtype="float32")
        torch.manual_seed(0)
        drafter = DFlashDrafter(build_drafter_config(
            target.text_config, num_layers=1, target_layer_ids=DEMO_LAYERS, block_size=4,
            mask_token_id=0))
        drafter.attach_target_head(target.embed_tokens, target.lm_head)
    return target, drafter


def test_a_sets_result_carries_its_rounds_by_context(models):
    target, drafter = models
    short, long = DEMO_TEXTS[0].encode(), (" ".join(DEMO_TEXTS[:6])).encode()
    assert len(short) + NEW < 128 <= len(long)  # the demo target's first edge between them
    events = []
    ev = Evaluator(EvalConfig(drafter_dtype="float32", best_set="long"), events.append,
                   dataset=None, eval_indices=[], layer_ids=DEMO_LAYERS, max_length=64,
                   loss_chunk=4096, seed=0, served_dtype="float32",
                   sets=[RunSet("long", (tuple(short), tuple(long)), NEW, frozenset())])
    assert ev.evaluate(10, drafter, target) == events[0].tau  # best follows the long set
    (res,) = events
    assert [r["bucket"] for r in res.context] == ["0-128", "128-512", "512-1k"]
    rounds = [r["rounds"] for r in res.context]
    assert rounds[0] > 0 and rounds[1] > 0 and rounds[2] == 0
    assert sum(rounds) == sum(res.acceptance)
    assert sum(r["accepted"] for r in res.context) == sum(k * n for k, n in
                                                          enumerate(res.acceptance))


def test_the_held_out_decodings_summary_counts_its_rounds_by_context(models):
    target, drafter = models
    prompts = [list(DEMO_TEXTS[1].encode()), list((" ".join(DEMO_TEXTS[:6])).encode())]
    res = evaluate_tau(target_fn_for(target, DEMO_LAYERS), drafter, prompts, NEW, DEMO_LAYERS)
    assert res.anchors == [[p - 1 for p in ps] for ps in res.positions]
    recs = res.by_context(Buckets.of(1024))
    assert [r["rounds"] for r in recs] == [len(a) for a in res.rounds_accepted] + [0]
    assert sum(r["rounds"] for r in recs) == res.rounds
