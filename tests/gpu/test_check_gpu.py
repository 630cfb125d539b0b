"""The train-to-serve check on the GPUs (compiled FlexAttention, the layout's drafter GPUs), here
and in the reference implementation; and the planted leak through the GPU's block mask."""

import torch

from dflash_core.check.serve_check import CheckOptions, run_check
from dflash_core.demo import demo_config
from dflash_core.models import block_attention
from tests.reference_impl import find_reference


def _cfg(tmp_path, name):
    cfg = demo_config(output_dir=str(tmp_path / "runs"), name=name, device="cuda")
    cfg.target.layer_ids = [0, 1, 2]  # below the demo target's last layer (docs/check.md)
    return cfg


def test_check_passes_on_the_gpus(tmp_path, demo_data):
    # A GPU node often has no network: the reference is used when it is importable (carried in
    # as a wheel), and check must then say plainly that it was not.
    reference, how = find_reference()
    print(f"reference implementation: {how}")
    lines = []
    result = run_check(_cfg(tmp_path, "gpu"), CheckOptions(samples=2), lines.append)
    assert result.verdict.passed, "\n".join(lines + result.evidence)
    if reference is not None:
        assert result.reference == "used"
    else:
        assert result.reference.startswith("not importable"), result.reference
        assert any("reference implementation not importable" in line for line in lines), lines
    assert any("on cuda:" in line for line in lines)


def test_check_finds_a_leak_in_the_gpu_block_mask(tmp_path, demo_data, monkeypatch):
    make = block_attention.make_block_mask

    def sees_its_anchor(anchors, ctx_len, block_size, causal=False):
        return make(torch.where(anchors >= 0, anchors + 1, anchors), ctx_len, block_size,
                    causal=causal)

    # drafter.py holds its own name for the mask builder.
    from dflash_core.models.dflash import drafter
    monkeypatch.setattr(drafter, "make_block_mask", sees_its_anchor)
    result = run_check(_cfg(tmp_path, "gpu-leak"), CheckOptions(samples=1, reference=False),
                       lambda m: None)
    assert not result.verdict.passed
    assert result.verdict.findings[0].what.startswith("a training-time leak")
