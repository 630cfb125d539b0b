"""The train-to-serve check of a DSpark drafter on the demo: memorised, it is accepted in
near-full blocks of B drafts (tau up to B+1) by chain drafting, with its own probes healthy; a
decoding that feeds the Markov head the wrong token, or a drafter trained in DFlash's layout, fails
naming that fault."""

from dataclasses import replace

import pytest
import torch

from dflash_core.check import diagnose as diag
from dflash_core.check.serve_check import CheckOptions, judge, prepare, release, train
from dflash_core.demo import demo_config
from dflash_core.models.dspark import loss as dspark_loss
from dflash_core.models.dspark.drafter import DSparkDrafter

FAST = CheckOptions(samples=1, response_tokens=32, max_steps=300)
B = 4

# Memorising the DSpark drafter is a training of ~40 s on the CPU: make test-slow. The fast
# path of its probes is tests/core/models/dspark/test_dspark_decoding.py; of check, the DFlash tests.
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("demo_target")]  # demo assets


def _cfg(tmp_path, name):
    cfg = demo_config(output_dir=str(tmp_path / "runs"), name=name, device="cpu")
    cfg.target.layer_ids = [0, 1, 2]
    cfg.drafter.block_size = B
    cfg.drafter.objective = "dspark"
    cfg.drafter.markov_rank = 16
    return cfg


@pytest.fixture(scope="module")
def healthy(tmp_path_factory, dflash_cache):
    prep = prepare(_cfg(tmp_path_factory.mktemp("check"), "dspark"), FAST, lambda m: None)
    mem = train(prep, FAST, lambda m: None)
    yield prep, mem
    release(prep)


def test_a_memorised_dspark_drafter_passes(healthy):
    prep, mem = healthy
    assert isinstance(mem.drafter, DSparkDrafter)
    assert mem.features.shape[-1] == 4 * mem.drafter.config.hidden_size  # 3 layers + last
    assert mem.reached and mem.tau_ceiling > B  # the anchor slot predicts: up to B+1
    lines = []
    result = judge(prep, mem, FAST, lines.append)
    assert result.verdict.passed, result.evidence
    assert "decodes DFlash drafters, not DSpark's" in result.reference
    ev = "\n".join(result.evidence)
    assert "DSpark probes at anchors" in ev and "last hidden_states entry" in ev
    assert "accepted per drafted token 1..4" in ev
    folder = prep.folder / "drafter"
    back = DSparkDrafter.load(folder)  # the served layout
    assert back.block_size == B and back.markov_rank == 16


def test_decoding_that_feeds_the_markov_head_the_anchor_fails(healthy, monkeypatch):
    prep, mem = healthy
    chained = DSparkDrafter.chain_draft

    def anchor_for_every_slot(self, context, last_token, num_tokens=None, markov_prev="drafted"):
        return chained(self, context, last_token, num_tokens, markov_prev="anchor")

    monkeypatch.setattr(DSparkDrafter, "chain_draft", anchor_for_every_slot)
    result = judge(prep, mem, replace(FAST, reference=False), lambda m: None)
    assert not result.verdict.passed
    assert any(f.what.startswith("decoding's chain feeds the Markov head otherwise")
               and "chain_draft" in f.fix for f in result.verdict.findings)


def test_a_drafter_trained_in_dflash_layout_is_named(tmp_path, dflash_cache, monkeypatch):
    """Labels of slot j = the token at anchor+j (off by one: DFlash's layout): memorised so, the
    drafter copies its own position and the check says slot 0 is not predicting."""
    targets = dspark_loss.dspark_targets

    def own_position(wide, anchor_tokens):
        labels, prev = targets(wide, anchor_tokens)
        shifted = torch.cat([anchor_tokens[..., None].to(labels.dtype), labels[..., :-1]], -1)
        return torch.where(labels >= 0, shifted, labels), prev

    monkeypatch.setattr(dspark_loss, "dspark_targets", own_position)
    cfg = _cfg(tmp_path, "layout")
    # cross-entropy alone: the target's distribution (TV, and the confidence label made from
    # it) would pull towards the right layout, which the planted labels contradict
    cfg.drafter.ce_weight, cfg.drafter.tv_weight, cfg.drafter.conf_weight = 1.0, 0.0, 0.0
    prep = prepare(cfg, FAST, lambda m: None)
    try:
        mem = train(prep, FAST, lambda m: None)
        monkeypatch.setattr(dspark_loss, "dspark_targets", targets)  # the probes' own labels
        result = judge(prep, mem, replace(FAST, reference=False), lambda m: None)
    finally:
        release(prep)
    assert not result.verdict.passed
    assert result.verdict.findings[0].what.startswith("slot 0 is not predicting")


def test_dspark_findings_come_first_and_fail_the_verdict():
    """The verdict rules on synthetic evidence: a DSpark fault fails a check whose decoding
    looks healthy, and is named first."""
    from dflash_core.check.decode import DecodeResult, SampleDecode
    from dflash_core.models.dspark.probes import DSparkProbes

    ours = DecodeResult("this engine", 4, [SampleDecode([1, 2, 3, 4, 5], [1, 2, 3, 4, 5], [4],
                                                        [(2, [1, 2, 3, 4])], 2)], drafts=4)
    assert ours.share == 1.0 and ours.accepted_at() == [1.0] * 4
    probes = diag.Probes(0.0, 0.0, 0.0, 0.0, features={0: 0.0}, last_hidden=0.0,
                         dspark=DSparkProbes([0.1] * 4, [0.9] * 4, 0.1, 0.1, 0.0, [2]))
    v = diag.diagnose(ours, None, memorised=True, tau_tf=5.0, ceiling_tf=5.0, probes=probes,
                      steps=10, trained_mask_id=0)
    assert not v.passed and v.findings[0].what.startswith("slot 0 is not predicting")
    probes.dspark = DSparkProbes([0.9] * 4, [0.1] * 4, 0.1, 0.1, 0.0, [2])
    probes.last_hidden = 0.5
    v = diag.diagnose(ours, None, memorised=True, tau_tf=5.0, ceiling_tf=5.0, probes=probes,
                      steps=10, trained_mask_id=0)
    assert not v.passed and "post-norm last hidden state" in v.findings[0].what
    probes.last_hidden = 0.0
    assert diag.diagnose(ours, None, memorised=True, tau_tf=5.0, ceiling_tf=5.0, probes=probes,
                         steps=10, trained_mask_id=0).passed
