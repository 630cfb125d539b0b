"""A rank's FP8 matmul (models/target/fp8_group.py) on the CPU, in one process: transformers'
FP8 layers kept (a GPU that keeps FP8 played as in test_fp8.py), its fp8_linear replaced by the
dequantizing one, gives the bf16 twin's features (dense) and the dequantized model's (Qwen3-MoE's
routed experts, which one process's engine linear cannot run); the agreement between ranks
without a process group is the rank's own verdict."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dflash_core.models.target import fp8, fp8_group
from dflash_core.models.target.load import load_target

from .fp8_twin import LAYERS, write_fp8_twin
from .test_fp8 import h200, ids  # noqa: F401
from .test_target_classes import fp8_checkpoint


@pytest.fixture
def dequantizing(monkeypatch):
    """use_dequantized_matmul replaces transformers' fp8_linear for the process (a rank is one
    target): put back after each test."""
    import transformers.integrations.finegrained_fp8 as hf_fp8
    monkeypatch.setattr(hf_fp8, "fp8_linear", hf_fp8.fp8_linear)
    return hf_fp8


def test_the_dequantizing_linear_is_the_product_with_the_dequantized_weight():
    gen = torch.Generator().manual_seed(3)
    q, scale = fp8.quantize_blockwise(torch.randn(256, 384, generator=gen))
    bias = torch.randn(256, generator=gen)
    x = torch.randn(3, 384, generator=gen, dtype=torch.bfloat16)
    w = fp8.dequantize_blockwise(q, scale, (128, 128), torch.bfloat16)
    got = fp8_group.dequantized_fp8_linear(x, q, scale, [128, 128], bias, None, True)
    assert got.dtype == torch.bfloat16 and torch.equal(got, F.linear(x, w, bias.bfloat16()))
    # a rank's slice under tensor parallel: its rows and their scale rows
    top = fp8_group.dequantized_fp8_linear(x, q[:128], scale[:1], [128, 128])
    assert torch.equal(top, F.linear(x, w[:128]))


def test_kept_fp8_layers_on_the_dequantizing_matmul_give_the_twins_features(
        tmp_path, h200, dequantizing):  # noqa: F811
    folder, bf16 = write_fp8_twin(tmp_path)
    target = load_target(folder, dtype=torch.bfloat16, fp8_matmul="transformers")
    assert len(fp8.fp8_linears(target.model)) == 7 * LAYERS  # transformers' own FP8Linear
    assert fp8_group.use_dequantized_matmul(target.model) == []
    assert dequantizing.fp8_linear is fp8_group.dequantized_fp8_linear
    twin = load_target(bf16, dtype=torch.bfloat16)
    x = ids(4)
    assert torch.equal(target.features(x, layer_ids=[0, 1, LAYERS - 1]),
                       twin.features(x, layer_ids=[0, 1, LAYERS - 1]))


def test_routed_fp8_experts_run_on_it_one_expert_at_a_time(tmp_path, h200,  # noqa: F811
                                                        dequantizing):
    ref = fp8_checkpoint(tmp_path)
    target = load_target(tmp_path, fp8_matmul="transformers")
    experts = [m for m in target.model.modules() if isinstance(m, dequantizing.FP8Experts)]
    assert experts and experts[0].gate_up_proj.dtype == torch.float8_e4m3fn
    assert fp8_group.use_dequantized_matmul(target.model) == []
    assert target.model.config._experts_implementation == "eager"
    x = torch.randint(0, 200, (2, 9), generator=torch.Generator().manual_seed(5))
    with torch.inference_mode():
        hs = ref(input_ids=x, output_hidden_states=True).hidden_states
    assert (target.features(x, layer_ids=[1]) - hs[2]).abs().max().item() < 1e-5


def test_settle_says_what_runs_the_weights(tmp_path, h200, dequantizing, monkeypatch):  # noqa: F811
    """Without a process group the rank's own verdict stands: transformers' kernels where the
    probe passes, else the dequantizing matmul, named with why."""
    folder, _ = write_fp8_twin(tmp_path)
    target = load_target(folder, dtype=torch.bfloat16, fp8_matmul="transformers")
    monkeypatch.setattr(fp8, "transformers_matmul_fails", lambda model, dtype: None)
    assert fp8_group.settle_matmul(target.model, "auto", torch.bfloat16,
                                   torch.device("cpu")) == fp8.TRANSFORMERS_MATMUL
    assert dequantizing.fp8_linear is not fp8_group.dequantized_fp8_linear
    monkeypatch.setattr(fp8, "transformers_matmul_fails", lambda model, dtype: "ImportError: x")
    said = fp8_group.settle_matmul(target.model, "auto", torch.bfloat16, torch.device("cpu"))
    assert said == (f"{fp8.ENGINE_MATMUL}: transformers' FP8 kernels do not run here "
                    "(ImportError: x)")
    assert dequantizing.fp8_linear is fp8_group.dequantized_fp8_linear
    assert fp8_group.settle_matmul(target.model, "engine", torch.bfloat16,
                                   torch.device("cpu")) == fp8.ENGINE_MATMUL
