"""FP8 block-wise target weights: whether they stay FP8 on a device, and what runs them there.

An FP8 block-wise checkpoint (config.json ``quantization_config: {quant_method: fp8,
weight_block_size: [128, 128]}``, as Qwen and DeepSeek publish theirs) stores each linear layer's
weight as ``float8_e4m3fn`` beside a float32 ``weight_scale_inv`` per 128 x 128 block (the weight
is ``weight * weight_scale_inv``, block by block); embeddings, lm_head and norms stay bf16.

transformers keeps such weights FP8 on a CUDA GPU of compute capability 8.9+ (H100, H200, 4090)
and dequantizes them as it loads elsewhere. It multiplies them with kernels the ``kernels``
package fetches from the Hugging Face Hub (finegrained-fp8's Triton kernel, or DeepGEMM on
Hopper), which quantize the activations to FP8 as well. Where those kernels cannot load (no
``kernels`` package, or no network and no cached copy) its FP8 linear layers fail at the first
forward. Then each of them is swapped for ``BlockFP8Linear``: the weight stays FP8 in memory and
is dequantized to the activations' dtype as it is used, one layer's weight at a time, with the
same float32 product transformers' own dequantization computes (so the features are those of the
dequantized model). Routed experts in FP8 have no such fallback in one process: without the kernels
the target is dequantized as it loads, said in one line with the memory that costs. A target
group's ranks have one (fp8_group.py).

The planning side (planning/quantized_check.py) asks ``fp8_dequantize_reason`` too, so the memory
plan counts what the loader will hold.
"""

from __future__ import annotations

import importlib.util
import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from dflash_core.models.target.shape import text_config

FP8_MIN_CAPABILITY = (8, 9)  # transformers' FineGrainedFP8 quantizer dequantizes below it
FP8_E4M3_MAX = 448.0  # largest finite float8_e4m3fn
FP8_DTYPES = tuple(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, n))
# How the kept weights are multiplied: "auto" tries transformers' kernels on one layer first and
# uses BlockFP8Linear where they do not run; "engine" always BlockFP8Linear; "transformers" never.
MATMULS = ("auto", "engine", "transformers")
# transformers' kernels quantize the activations too: against the dequantized weights their output
# is a few percent off (1/16 is e4m3's rounding step); more than this is a kernel that misbehaves.
PROBE_TOLERANCE = 0.2
PROBE_ROWS = 16
# Scales BlockFP8Linear multiplies by as they are (power-of-two ue8m0 scales are not among them:
# those layers are left to transformers).
SCALE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
HEADER_BYTES = {"F64": 8, "F32": 4, "BF16": 2, "F16": 2, "U8": 1, "I8": 1}  # safetensors dtypes
ENGINE_MATMUL = "the engine's FP8 linear (each weight dequantized as it is used)"
TRANSFORMERS_MATMUL = "transformers' FP8 kernels"


def fp8_quantization(hf_config: dict) -> dict | None:
    """A config.json's ``quantization_config`` when its method is fp8 (top level, or in a nested
    text config), else None."""
    q = hf_config.get("quantization_config") or text_config(hf_config).get("quantization_config")
    return q if isinstance(q, dict) and q.get("quant_method") == "fp8" else None


def device_capability(device: torch.device) -> tuple[int, int]:
    """The CUDA device's compute capability (the one place it is asked: tests replace it)."""
    major, minor = torch.cuda.get_device_capability(device)
    return int(major), int(minor)


def kernels_installed() -> bool:
    """transformers fetches its FP8 kernels through the ``kernels`` package, or has none."""
    return importlib.util.find_spec("kernels") is not None


def fp8_dequantize_reason(devices: list[torch.device], routed_experts: bool) -> str | None:
    """Why an FP8 block-wise target is dequantized as it loads on ``devices`` (None: its weights
    stay FP8). ``routed_experts``: the model has FP8 routed experts, which only transformers'
    kernels run."""
    gpus = [d for d in devices if d.type == "cuda"]
    if not gpus:
        return "the target runs on the CPU"
    for d in gpus:
        cap = device_capability(d)
        if cap < FP8_MIN_CAPABILITY:
            need = ".".join(map(str, FP8_MIN_CAPABILITY))
            return (f"cuda:{d.index or 0} has compute capability {cap[0]}.{cap[1]}, "
                    f"fp8 needs {need}+")
    if routed_experts and not kernels_installed():
        return ("its routed experts run only on transformers' FP8 kernels, which need the "
                "kernels package (not installed)")
    return None


def dequantize_as_loaded(config) -> None:
    """Tell transformers to dequantize an FP8 checkpoint's weights as it loads (a transformers
    config, changed in place; other configs are left alone). Left to itself it decides by the
    current CUDA device, not the model's, and keeps FP8 layers on a CPU model beside a GPU,
    layers nothing could then run."""
    quant = getattr(config, "quantization_config", None)
    if isinstance(quant, dict) and quant.get("quant_method") == "fp8":
        config.quantization_config = {**quant, "dequantize": True}
    elif getattr(quant, "quant_method", None) == "fp8":
        quant.dequantize = True


def expected_matmul() -> str:
    """What will multiply kept FP8 weights, as said before loading."""
    if kernels_installed():
        return f"{TRANSFORMERS_MATMUL} where they load, else {ENGINE_MATMUL}"
    return f"{ENGINE_MATMUL}; {TRANSFORMERS_MATMUL} need the kernels package"


@dataclass(frozen=True)
class QuantizedNote:
    """How the loader holds a quantized checkpoint's weights, in one line. ``kept``: they stayed
    FP8. ``planned``: the line follows from the config and the device alone, as preflight says it
    before loading (a run's log then has it already); not planned: learnt from the loaded model
    (which matmul runs, or a load again dequantized)."""

    line: str
    kept: bool
    planned: bool


# --------------------------------------------------------------------------------------------
# Block-wise quantization and its inverse
# --------------------------------------------------------------------------------------------

def dequantize_blockwise(weight: torch.Tensor, scale_inv: torch.Tensor,
                         block: tuple[int, int] | None, dtype: torch.dtype) -> torch.Tensor:
    """The [rows, cols] weight an FP8 one stands for, in ``dtype``: each block times its
    ``scale_inv`` in float32, rounded once (as transformers dequantizes at load). ``block`` None
    or a single scale: one scale for the whole tensor. Transient: the float32 copy."""
    w = weight.to(torch.float32)
    scale = scale_inv.to(torch.float32)
    if block is None or scale.numel() == 1:
        return w.mul_(scale.reshape(())).to(dtype)
    rows, cols = w.shape
    sr, sc = scale.shape
    br, bc = block
    if rows == sr * br and cols == sc * bc:
        w.view(sr, br, sc, bc).mul_(scale[:, None, :, None])
    else:  # the last row / column of blocks is narrower
        w.mul_(scale.repeat_interleave(br, 0)[:rows].repeat_interleave(bc, 1)[:, :cols])
    return w.to(dtype)


def quantize_blockwise(weight: torch.Tensor, block: tuple[int, int] = (128, 128)
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8_e4m3fn weight, float32 scale_inv of shape [ceil(rows/br), ceil(cols/bc)]) of a 2-D
    weight, each block scaled so its largest value is e4m3's largest: as FP8 block-wise
    checkpoints store them (tests and benchmarks write such checkpoints)."""
    rows, cols = weight.shape
    br, bc = block
    sr, sc = math.ceil(rows / br), math.ceil(cols / bc)
    padded = weight.new_zeros((sr * br, sc * bc), dtype=torch.float32)
    padded[:rows, :cols] = weight
    blocks = padded.view(sr, br, sc, bc)
    # an all-zero block keeps scale 1 (its values stay 0) rather than dividing by 0
    amax = blocks.abs().amax(dim=(1, 3))
    scale = torch.where(amax > 0, amax / FP8_E4M3_MAX, torch.ones_like(amax))
    quant = (blocks / scale[:, None, :, None]).clamp_(-FP8_E4M3_MAX, FP8_E4M3_MAX)
    quant = quant.to(torch.float8_e4m3fn).view(sr * br, sc * bc)[:rows, :cols].contiguous()
    return quant, scale


class BlockFP8Linear(nn.Module):
    """A frozen linear layer whose weight stays FP8 in memory: each forward dequantizes it to the
    input's dtype (one float32 and one dtype copy of this weight, freed after the product) and
    runs the plain product. The activations stay unquantized. Same parameter names as
    transformers' FP8Linear (``weight``, ``weight_scale_inv``, ``bias``)."""

    def __init__(self, weight: torch.Tensor, scale_inv: torch.Tensor,
                 block_size: tuple[int, int] | None, bias: torch.Tensor | None = None):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.block_size = tuple(block_size) if block_size else None
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.weight_scale_inv = nn.Parameter(scale_inv, requires_grad=False)
        self.bias = nn.Parameter(bias, requires_grad=False) if bias is not None else None

    @classmethod
    def from_module(cls, module: nn.Module) -> "BlockFP8Linear":
        return cls(module.weight.data, module.weight_scale_inv.data,
                   getattr(module, "block_size", None),
                   module.bias.data if getattr(module, "bias", None) is not None else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = dequantize_blockwise(self.weight, self.weight_scale_inv, self.block_size, x.dtype)
        bias = self.bias.to(x.dtype) if self.bias is not None else None
        return F.linear(x, w, bias)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"block_size={self.block_size}, bias={self.bias is not None}")


# --------------------------------------------------------------------------------------------
# A loaded model's FP8 layers
# --------------------------------------------------------------------------------------------

def fp8_linears(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """transformers' FP8 linear layers of a loaded model: a 2-D float8 weight with its
    ``weight_scale_inv`` (grouped linears, with ``n_groups``, are not among them)."""
    return [(name, m) for name, m in model.named_modules()
            if isinstance(m, nn.Linear) and not isinstance(m, BlockFP8Linear)
            and m.weight.dtype in FP8_DTYPES and m.weight.dim() == 2
            and isinstance(getattr(m, "weight_scale_inv", None), torch.Tensor)
            and m.weight_scale_inv.dtype in SCALE_DTYPES and not hasattr(m, "n_groups")]


def fp8_left(model: nn.Module) -> list[str]:
    """FP8 tensors outside BlockFP8Linear layers: what only transformers' kernels run."""
    return [f"{mname}.{pname}" if mname else pname
            for mname, m in model.named_modules() if not isinstance(m, BlockFP8Linear)
            for pname, p in m.named_parameters(recurse=False) if p.dtype in FP8_DTYPES]


def transformers_matmul_fails(model: nn.Module, dtype: torch.dtype) -> str | None:
    """Why transformers' FP8 kernels cannot run this model's FP8 linear layers (None: they ran
    one on a few random rows and agreed with its dequantized weight)."""
    linears = fp8_linears(model)
    if not linears:
        return None
    name, m = linears[0]
    gen = torch.Generator(device=m.weight.device).manual_seed(0)
    x = torch.randn(PROBE_ROWS, m.in_features, generator=gen, device=m.weight.device,
                    dtype=dtype)
    try:
        with torch.inference_mode():
            got = m(x).float()
    # The kernels are optional and fetched at first use: any failure (not installed, no network,
    # no build for this torch / CUDA) means the weights run on BlockFP8Linear instead.
    except Exception as exc:  # noqa: BLE001
        text = str(exc).strip().splitlines()[0].split(". ")[0] if str(exc).strip() else ""
        return f"{type(exc).__name__}: {text[:160]}"
    w = dequantize_blockwise(m.weight, m.weight_scale_inv, getattr(m, "block_size", None),
                             torch.float32)
    want = F.linear(x.float(), w, None if m.bias is None else m.bias.float())
    off = ((got - want).norm() / want.norm().clamp_min(1e-30)).item()
    if not math.isfinite(off) or off > PROBE_TOLERANCE:
        return f"their output on {name} is {off:.0%} off its dequantized weight's"
    return None


def use_engine_matmul(model: nn.Module) -> int:
    """Swap every transformers FP8 linear layer for a BlockFP8Linear holding the same tensors;
    returns how many."""
    linears = fp8_linears(model)
    for name, m in linears:
        model.set_submodule(name, BlockFP8Linear.from_module(m))
    return len(linears)


# --------------------------------------------------------------------------------------------
# What the checkpoint's weights take, from its safetensors headers
# --------------------------------------------------------------------------------------------

def checkpoint_bytes(files: list[Path], dtype: torch.dtype) -> tuple[int, int]:
    """(bytes of the weights as stored, FP8 kept; bytes dequantized to ``dtype``) from the shards'
    headers: FP8 tensors 1 byte per value and their scales, or ``dtype`` without scales; every
    other tensor in ``dtype`` either way (transformers casts it)."""
    from safetensors import safe_open

    b = torch.empty((), dtype=dtype).element_size()
    stored = plain = 0
    for file in files:
        with safe_open(str(file), "pt") as f:
            for key in f.keys():
                t = f.get_slice(key)
                n = math.prod(t.get_shape())
                kind = t.get_dtype()
                if kind.startswith("F8"):
                    stored, plain = stored + n, plain + n * b
                elif key.endswith("_scale_inv") or key.endswith("activation_scale"):
                    stored += n * HEADER_BYTES.get(kind, 4)
                else:
                    stored, plain = stored + n * b, plain + n * b
    return stored, plain
