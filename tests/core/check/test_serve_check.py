"""The train-to-serve check on the demo: the healthy demo passes (here and in the reference
implementation); planted faults fail with their own diagnosis."""

from dataclasses import replace

import pytest
import torch

from dflash_core.check import diagnose as diag
from dflash_core.check.serve_check import CheckOptions, judge, prepare, release, run_check, train
from dflash_core.demo import demo_config
from dflash_core.models import block_attention, objective
from dflash_core.models.dflash.drafter import DFlashDrafter

# The demo's assets, built by the session's fixture (a fresh cache builds them beside other tests).
pytestmark = pytest.mark.usefixtures("demo_target")

# One sample, a short response: memorised in well under 100 steps on the demo.
FAST = CheckOptions(samples=1, response_tokens=32, max_steps=200)


def _cfg(tmp_path, name, layers=None):
    """The shipped demo (its layers below the target's last), or other ``layers``."""
    cfg = demo_config(output_dir=str(tmp_path / "runs"), name=name, device="cpu")
    if layers is not None:
        cfg.target.layer_ids = list(layers)
    return cfg


@pytest.fixture(scope="module")
def healthy(tmp_path_factory, dflash_cache, reference_dflash):
    """The demo prepared and memorised once; the tests judge it (with or without a fault)."""
    cfg = _cfg(tmp_path_factory.mktemp("check"), "healthy")
    prep = prepare(cfg, FAST, lambda m: None)
    mem = train(prep, FAST, lambda m: None)
    yield prep, mem
    release(prep)


def test_healthy_demo_passes_here_and_in_the_reference(healthy):
    prep, mem = healthy
    assert mem.reached and mem.steps < FAST.max_steps
    lines = []
    result = judge(prep, mem, FAST, lines.append)
    assert result.verdict.passed, result.evidence
    assert result.exit_code == 0
    assert result.reference == "used"  # decoded by dflash.model.DFlashDraftModel too
    assert any("reference dflash==0.1.0: exact tau" in line for line in lines)
    assert (prep.folder / "drafter" / "model.safetensors").is_file()
    assert (prep.folder / "check.json").is_file()


def test_wrong_mask_token_at_decode(healthy, monkeypatch):
    prep, mem = healthy
    drafted = DFlashDrafter.draft

    def draft_with_another_mask(self, *args, **kwargs):
        trained, self.mask_token_id = self.mask_token_id, 0
        try:
            return drafted(self, *args, **kwargs)
        finally:
            self.mask_token_id = trained

    monkeypatch.setattr(DFlashDrafter, "draft", draft_with_another_mask)
    result = judge(prep, mem, replace(FAST, reference=False), lambda m: None)
    assert not result.verdict.passed and result.exit_code == 1
    first = result.verdict.findings[0]
    assert first.what.startswith("decoding builds the block differently")
    assert "mask token" in first.what and "drafter.mask_token_id" in first.fix


def test_decoding_uses_the_uncompiled_attention_and_gives_the_drafter_back(healthy, monkeypatch):
    prep, mem = healthy
    drafted, seen = DFlashDrafter.draft, []

    def draft(self, *args, **kwargs):
        seen.append(self.attn_impl)
        return drafted(self, *args, **kwargs)

    monkeypatch.setattr(DFlashDrafter, "draft", draft)
    attn = mem.drafter.attn_impl
    mem.drafter.attn_impl = "auto"  # training's (compiled flex on a GPU); decoding gives it back
    try:
        result = judge(prep, mem, replace(FAST, reference=False), lambda line: None)
        assert mem.drafter.attn_impl == "auto"
    finally:
        mem.drafter.attn_impl = attn  # the module's drafter is shared
    assert result.verdict.passed, result.evidence
    assert seen and seen[0] == "chunked"


def test_labels_shifted_by_one(tmp_path, dflash_cache, monkeypatch):
    labels = objective.block_labels

    def shifted(input_ids, loss_mask, anchors, block_size):
        return labels(input_ids, loss_mask, torch.where(anchors >= 0, anchors + 1, anchors),
                      block_size)

    monkeypatch.setattr(objective, "block_labels", shifted)
    result = run_check(_cfg(tmp_path, "shifted"), replace(FAST, reference=False), lambda m: None)
    assert not result.verdict.passed
    first = result.verdict.findings[0]
    assert first.what.startswith("labels shifted by one")
    assert "one position later" in first.what


def test_leak_in_the_training_attention(tmp_path, dflash_cache, monkeypatch):
    attend = block_attention.chunked_block_attention

    def sees_its_anchor(q, k_ctx, v_ctx, k_blk, v_blk, anchors, *args, **kwargs):
        # Each block also sees the context AT its anchor: nothing changes at decoding, where
        # the context ends before the anchor.
        return attend(q, k_ctx, v_ctx, k_blk, v_blk,
                      torch.where(anchors >= 0, anchors + 1, anchors), *args, **kwargs)

    monkeypatch.setattr(block_attention, "chunked_block_attention", sees_its_anchor)
    result = run_check(_cfg(tmp_path, "leak"), replace(FAST, reference=False), lambda m: None)
    assert not result.verdict.passed
    assert result.verdict.findings[0].what.startswith("a training-time leak")


@pytest.mark.slow
def test_the_last_layer_as_a_feature_passes_with_the_reference(tmp_path, dflash_cache,
                                                               reference_dflash):
    """Layer ids that end at the target's last layer (the demo's before issue 46): transformers,
    and so the reference, returns it after the final norm; the engine's feature is that too, so
    the check passes here and in the reference (it failed before the engine normed the last
    layer), after the preflight's one warning that serving stacks read it before the norm."""
    lines = []
    result = run_check(_cfg(tmp_path, "last", [1, 2, 3]), FAST, lines.append)
    assert result.verdict.passed, result.evidence
    assert result.reference == "used"
    (warned,) = [line for line in lines if "warning:" in line]
    assert "includes layer 3, the target's last" in warned and "before the norm" in warned


def test_verdict_rules_on_synthetic_evidence():
    """Acceptance alone: slot 1 right and later slots wrong points at the mask token."""
    from dflash_core.check.decode import DecodeResult, SampleDecode

    resp = list(range(10, 26))
    # Every round proposes 3 tokens (block 4): the first right, the others wrong.
    drafts, acc, s = [], [], 4
    while s + 4 <= 4 + len(resp):
        drafts.append((s, [resp[s - 4 + 1], 0, 0]))
        acc.append(1)
        s += 2
    d = DecodeResult("this engine", 4, [SampleDecode(resp, resp, acc, drafts, 4)])
    assert d.accepted_at()[0] == 1.0 and d.accepted_at()[1] == 0.0
    probes = diag.Probes(leak=0.0, leak_changed=0.0, decode_differs=1.0, decode_gap=0.5)
    v = diag.diagnose(d, None, memorised=True, tau_tf=3.9, ceiling_tf=4.0, probes=probes,
                      steps=10, trained_mask_id=7)
    assert not v.passed
    assert "(slot 1 accepted, later slots not: the mask token)" in v.findings[0].what


def test_the_drafter_decodes_in_its_served_dtype(healthy, monkeypatch):
    """Decoding casts the memorised drafter to drafter.dtype (the served one; the demo's is
    float32) or --drafter-dtype; the trained weights stay as they were."""
    prep, mem = healthy
    assert prep.drafter_dtype == prep.cfg.drafter.dtype  # the default: the served dtype
    seen = []
    forward = DFlashDrafter.forward

    def spy(self, *args, **kwargs):
        seen.append(self.fc.weight.dtype)
        return forward(self, *args, **kwargs)
    monkeypatch.setattr(DFlashDrafter, "forward", spy)
    result = judge(replace(prep, drafter_dtype="bfloat16"), mem,
                   replace(FAST, reference=False), lambda m: None)
    assert result.drafter_dtype == "bfloat16" and torch.bfloat16 in seen
    assert all(p.dtype == torch.float32 for p in mem.drafter.parameters())


def test_a_config_with_a_target_group_loads_it_as_a_group(tmp_path):
    """check loads a run's target group as the run does (test_check_group.py decodes through
    it): said before the ranks start, the first copy's devices named."""
    cfg = _cfg(tmp_path, "group")
    cfg.layout.targets = [0, 1]
    cfg.target.gpus_per_copy = 2
    lines: list[str] = []

    class Enough(Exception):
        pass

    def say(line: str) -> None:  # what follows is the group's start and the check's usual work
        lines.append(line)
        if "as a target group" in line:
            raise Enough

    with pytest.raises(Enough):
        prepare(cfg, FAST, say)
    assert lines[-1].endswith("as a target group of 2 ranks on cpu, cpu"), lines
    assert not [x for x in lines if "whole on one device" in x]
