"""FP8 block-wise targets on the CPU: the block-wise quantization and its inverse, the engine's FP8
linear, the rule that keeps the weights FP8 (the GPU's compute capability asked through a stand-in)
and the loader on both sides of it. A GPU that keeps FP8 is played on the CPU by answering
transformers' CUDA questions as an H200 would: transformers then builds its FP8 layers, whose
kernels cannot load here, as on a GPU machine without the kernels package (or with one that
cannot fetch them from the hub)."""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dflash_core.models.target import fp8
from dflash_core.models.target.fp8 import (
    BlockFP8Linear, checkpoint_bytes, dequantize_blockwise, fp8_dequantize_reason,
    quantize_blockwise,
)
from dflash_core.models.target.load import load_target

from .fp8_twin import LAYERS, write_fp8_twin
from .test_target_classes import _fp8_blockwise, fp8_checkpoint

# Why transformers' kernels failed depends on the machine (no kernels package: ImportError; one
# that cannot reach the hub: ValueError): the note must name the exception and its message.
KERNELS_FAIL = re.compile(r"transformers' FP8 kernels do not run here \(\w+: \S[^)]*\)")


def param_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


@pytest.fixture(scope="module")
def twin(tmp_path_factory):
    return write_fp8_twin(tmp_path_factory.mktemp("fp8"))


@pytest.fixture
def h200(monkeypatch):
    """transformers asks torch whether CUDA is there and its compute capability (then keeps FP8
    layers); the loader asks fp8_dequantize_reason, told here that the device keeps FP8."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (9, 0))
    monkeypatch.setattr(fp8, "fp8_dequantize_reason", lambda devices, experts: None)


def ids(seed=1, shape=(2, 13)):
    return torch.randint(0, 500, shape, generator=torch.Generator().manual_seed(seed))


# --------------------------------------------------------------------------------------------
# Quantization and the engine's FP8 linear
# --------------------------------------------------------------------------------------------

def test_quantize_blockwise_stores_what_fp8_checkpoints_store():
    """The same float8 values and scales as the block-by-block loop, and the weight they stand
    for back from dequantize_blockwise, to the bit."""
    w = torch.randn(384, 256, generator=torch.Generator().manual_seed(0)) * 0.05
    w[:128, 128:] = 0  # an all-zero block stays zero
    q, scale = quantize_blockwise(w)
    want_q, want_scale, want_w = _fp8_blockwise(w)
    assert q.dtype == torch.float8_e4m3fn and scale.dtype == torch.float32
    assert scale.shape == (3, 2)
    assert torch.equal(q.view(torch.uint8)[:, :128], want_q.view(torch.uint8)[:, :128])
    assert torch.equal(scale[:, 0], want_scale[:, 0]) and scale[0, 1] == 1
    back = dequantize_blockwise(q, scale, (128, 128), torch.float32)
    assert torch.equal(back[:, :128], want_w[:, :128]) and not back[:128, 128:].any()
    # e4m3 keeps 3 bits of mantissa: within 1/16 of each value, a few percent overall
    assert (back - w).norm() / w.norm() < 0.04


def test_a_ragged_edge_and_a_per_tensor_scale():
    w = torch.randn(200, 300, generator=torch.Generator().manual_seed(1))
    q, scale = quantize_blockwise(w)
    assert scale.shape == (2, 3)
    back = dequantize_blockwise(q, scale, (128, 128), torch.float32)
    expand = scale.repeat_interleave(128, 0)[:200].repeat_interleave(128, 1)[:, :300]
    assert torch.equal(back, q.float() * expand)
    one = torch.tensor(0.5)
    assert torch.equal(dequantize_blockwise(q, one, None, torch.float32), q.float() * 0.5)


def test_block_fp8_linear_is_the_product_with_its_dequantized_weight():
    gen = torch.Generator().manual_seed(2)
    q, scale = quantize_blockwise(torch.randn(256, 384, generator=gen))
    bias = torch.randn(256, generator=gen)
    layer = BlockFP8Linear(q, scale, (128, 128), bias)
    assert layer.weight.dtype == torch.float8_e4m3fn and not layer.weight.requires_grad
    x = torch.randn(2, 5, 384, generator=gen, dtype=torch.bfloat16)
    want = F.linear(x, dequantize_blockwise(q, scale, (128, 128), torch.bfloat16),
                    bias.to(torch.bfloat16))
    got = layer(x)
    assert got.dtype == torch.bfloat16 and torch.equal(got, want)
    assert layer.weight.dtype == torch.float8_e4m3fn  # still FP8 after the forward


# --------------------------------------------------------------------------------------------
# The rule
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("devices, caps, experts, kernels, says", [
    (["cpu"], {}, False, False, "the target runs on the CPU"),
    (["cuda:0"], {0: (8, 0)}, False, True, "cuda:0 has compute capability 8.0, fp8 needs 8.9+"),
    (["cuda:0", "cuda:1"], {0: (9, 0), 1: (8, 6)}, False, True, "cuda:1 has compute capability"),
    (["cuda:0"], {0: (8, 9)}, False, False, None),
    (["cuda:0"], {0: (9, 0)}, False, False, None),
    (["cuda:0"], {0: (9, 0)}, True, False, "routed experts run only on transformers' FP8 kernels"),
    (["cuda:0"], {0: (9, 0)}, True, True, None),
])
def test_fp8_stays_fp8_on_gpus_of_capability_8_9(monkeypatch, devices, caps, experts, kernels,
                                                  says):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d: caps[d.index])
    monkeypatch.setattr(fp8, "kernels_installed", lambda: kernels)
    why = fp8_dequantize_reason([torch.device(d) for d in devices], experts)
    assert why == says if says is None else says in why


# --------------------------------------------------------------------------------------------
# The loader
# --------------------------------------------------------------------------------------------

def test_on_the_cpu_the_loader_dequantizes_and_says_what_it_costs(twin):
    folder, bf16 = twin
    said = []
    target = load_target(folder, say=said.append)  # float32, as CPU targets run
    stored, plain = checkpoint_bytes([folder / "model.safetensors"], torch.float32)
    assert plain == param_bytes(target.model)  # the line's figure is the loaded model's
    assert len(said) == 1 and target.quantized == fp8.QuantizedNote(said[0], kept=False,
                                                                    planned=True)
    assert said[0].startswith("target: FP8 block-wise weights dequantized to float32 as they "
                              "load (the target runs on the CPU)")
    assert f"{plain / 2**20:.1f} MiB instead of {stored / 2**20:.1f} MiB kept FP8" in said[0]
    assert all(p.dtype == torch.float32 for p in target.model.parameters())
    # the weights the FP8 ones stand for (the twin holds them rounded to bf16)
    twin_target = load_target(bf16)
    assert twin_target.quantized is None
    twin_weights = twin_target.model.state_dict()
    for name, w in target.model.state_dict().items():
        assert torch.equal(w.to(torch.bfloat16).float(), twin_weights[name]), name


def test_kept_fp8_runs_on_the_engines_linear_where_transformers_kernels_do_not(twin, h200):
    """On a GPU that keeps FP8 but cannot load transformers' kernels (no kernels package, or one
    that cannot fetch them, as on a node without network): the weights stay float8, every projection runs on BlockFP8Linear, the
    one line says so and why, and the features are the bf16 twin's to the bit."""
    folder, bf16 = twin
    said = []
    target = load_target(folder, dtype=torch.bfloat16, say=said.append)
    layers = target.model.model.layers
    projections = [m for layer in layers for m in layer.modules()
                   if type(m) is BlockFP8Linear]
    assert len(projections) == 7 * LAYERS  # q k v o gate up down
    assert all(m.weight.dtype == torch.float8_e4m3fn for m in projections)
    assert target.lm_head.weight.dtype == torch.bfloat16  # the drafter borrows it
    stored, plain = checkpoint_bytes([folder / "model.safetensors"], torch.bfloat16)
    assert param_bytes(target.model) == stored < 0.7 * plain
    assert len(said) == 1 and said[0].startswith(
        f"target: FP8 block-wise weights stay FP8 on cpu: {stored / 2**20:.1f} MiB "
        f"({plain / 2**20:.1f} MiB in bfloat16), run by the engine's FP8 linear")
    assert KERNELS_FAIL.search(said[0]), said[0]
    assert target.quantized.kept and not target.quantized.planned
    twin_target = load_target(bf16, dtype=torch.bfloat16)
    x = ids(3)
    assert torch.equal(target.features(x, layer_ids=[0, 1, LAYERS - 1]),
                       twin_target.features(x, layer_ids=[0, 1, LAYERS - 1]))
    logits, _ = target.logits_and_features(x, [1])
    want, _ = twin_target.logits_and_features(x, [1])
    assert torch.equal(logits, want)


def test_fp8_matmul_engine_skips_the_probe_and_transformers_keeps_its_layers(twin, h200,
                                                                             monkeypatch):
    folder, _ = twin

    def probe(*args):
        raise AssertionError("probed")
    monkeypatch.setattr(fp8, "transformers_matmul_fails", probe)
    said = []
    target = load_target(folder, dtype=torch.bfloat16, say=said.append, fp8_matmul="engine")
    assert said[0].endswith("run by the engine's FP8 linear (each weight dequantized as it is "
                            "used)")
    assert not fp8.fp8_left(target.model)
    said.clear()
    target = load_target(folder, dtype=torch.bfloat16, say=said.append,
                         fp8_matmul="transformers")
    assert said[0].endswith("run by transformers' FP8 kernels")
    assert len(fp8.fp8_linears(target.model)) == 7 * LAYERS
    with pytest.raises(ValueError, match="fp8_matmul 'fast'"):
        load_target(folder, fp8_matmul="fast")


class _Kernel(nn.Linear):
    """A stand-in for transformers' FP8Linear whose kernel gives ``factor`` x the product."""

    def __init__(self, factor: float):
        gen = torch.Generator().manual_seed(4)
        q, scale = quantize_blockwise(torch.randn(128, 256, generator=gen))
        super().__init__(256, 128, bias=False)
        self.weight = nn.Parameter(q, requires_grad=False)
        self.weight_scale_inv = nn.Parameter(scale, requires_grad=False)
        self.block_size, self.factor = (128, 128), factor

    def forward(self, x):
        w = dequantize_blockwise(self.weight, self.weight_scale_inv, self.block_size, x.dtype)
        return F.linear(x, w) * self.factor


@pytest.mark.parametrize("factor, fails", [(1.0, None), (1.03, None), (1.5, "50% off")])
def test_the_probe_takes_transformers_kernels_only_when_they_agree(factor, fails):
    model = nn.Sequential(_Kernel(factor))
    got = fp8.transformers_matmul_fails(model, torch.float32)
    assert got == fails if fails is None else fails in got
    assert fp8.use_engine_matmul(model) == 1 and type(model[0]) is BlockFP8Linear


def test_fp8_experts_whose_kernels_do_not_run_are_loaded_again_dequantized(tmp_path, h200):
    """A Qwen3-MoE FP8 checkpoint on a GPU that keeps FP8 where transformers' kernels cannot
    load: the engine's linear covers the attention, not the routed experts, so the target is
    loaded again dequantized, said once, and gives the weights the checkpoint stands for."""
    ref = fp8_checkpoint(tmp_path)
    said = []
    target = load_target(tmp_path, say=said.append)
    assert len(said) == 1 and "dequantized to float32 as they load (" in said[0]
    assert KERNELS_FAIL.search(said[0]) and "experts" in said[0], said[0]
    assert not fp8.fp8_left(target.model)
    assert not target.quantized.kept and not target.quantized.planned  # preflight said kept
    x = torch.randint(0, 200, (2, 9), generator=torch.Generator().manual_seed(5))
    with torch.inference_mode():
        hs = ref(input_ids=x, output_hidden_states=True).hidden_states
    assert (target.features(x, layer_ids=[1]) - hs[2]).abs().max().item() < 1e-5


def test_a_cpu_target_beside_a_gpu_that_keeps_fp8_is_dequantized(twin, monkeypatch):
    """transformers asks the current CUDA device, not the target's: beside an H200 it would keep
    FP8 layers on a CPU target, which nothing runs there. The loader, and the CPU model data
    inspect and the demo load, dequantize them."""
    from dflash_core.demo import load_lm

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (9, 0))
    folder, _ = twin
    said = []
    target = load_target(folder, say=said.append)
    assert "(the target runs on the CPU)" in said[0] and not fp8.fp8_left(target.model)
    model = load_lm(folder)
    assert not fp8.fp8_left(model)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    x = ids(6)
    with torch.inference_mode():
        logits = model(input_ids=x).logits
    assert torch.equal(logits, target.logits_and_features(x, [0])[0])


def test_fp8_experts_with_the_engines_linear_asked_for_are_loaded_dequantized(tmp_path, h200):
    fp8_checkpoint(tmp_path)
    said = []
    target = load_target(tmp_path, say=said.append, fp8_matmul="engine")
    assert len(said) == 1 and "(fp8_matmul engine was asked for and 4 FP8 tensors such as " \
        "model.layers.0.mlp.experts." in said[0]
    assert not fp8.fp8_left(target.model) and not target.quantized.kept
