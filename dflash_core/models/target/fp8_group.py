"""FP8 block-wise weights kept FP8 in a rank of a target group (target_group/rank.py), and what
multiplies them there.

transformers loads the rank's share as its FP8 integration builds it: ``FP8Linear`` layers and
``FP8Experts`` holding float8 weights beside their ``weight_scale_inv``, split by its
tensor-parallel, expert-parallel and FSDP plans (the scales split with their weights). Both
multiply through one function of that integration, ``fp8_linear`` (its kernels, fetched by the
``kernels`` package). Where those kernels do not run, this process's ``fp8_linear`` becomes
``dequantized_fp8_linear``: the weight it is handed (a rank's slice under tensor parallel, the
gathered weight under FSDP, one expert's under expert parallel) is dequantized to the
activations' dtype, as transformers dequantizes at load, and multiplied plainly, so the features
are the dequantized model's; the routed experts run their eager loop, which multiplies one
expert at a time through the same function. This is what a single-process target does with
``BlockFP8Linear`` (fp8.py), but without swapping modules: tensor parallel wraps each layer's own
forward and FSDP holds each layer's parameters, and a new module would lose both. The function is
replaced for the whole process, which a rank is: one target and nothing else.

The ranks agree on the choice (one all-reduce), so no rank multiplies differently.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dflash_core.models.target import fp8 as fp8_weights

PROBE_SIDE = 2  # the probe layer's blocks per side


def dequantized_fp8_linear(input: torch.Tensor, weight: torch.Tensor,
                           weight_scale_inv: torch.Tensor, block_size=None, bias=None,
                           activation_scale=None, allow_deepgemm: bool = True) -> torch.Tensor:
    """transformers' ``fp8_linear`` (same arguments) by dequantizing the weight: the plain
    product with the weight it stands for, in the input's dtype. Activations are not quantized,
    so a static ``activation_scale`` is not used (as transformers' own dequantized load)."""
    block = tuple(block_size) if block_size else None
    w = fp8_weights.dequantize_blockwise(weight, weight_scale_inv, block, input.dtype)
    return F.linear(input, w, None if bias is None else bias.to(input.dtype))


def _probe_layer(block: tuple[int, int] | None, device: torch.device) -> nn.Module:
    """A standalone transformers FP8 linear layer of random weights on ``device``: what its
    kernels do, asked away from the model's split layers (whose parameters are slices)."""
    from transformers.integrations.finegrained_fp8 import FP8Linear

    rows, cols = (PROBE_SIDE * block[0], PROBE_SIDE * block[1]) if block else (256, 256)
    gen = torch.Generator().manual_seed(0)
    q, scale = fp8_weights.quantize_blockwise(torch.randn(rows, cols, generator=gen),
                                              block or (rows, cols))
    with torch.device("meta"):
        layer = FP8Linear(cols, rows, block_size=block)
    layer.weight = nn.Parameter(q.to(device), requires_grad=False)
    layer.weight_scale_inv = nn.Parameter((scale if block else scale.reshape(())).to(device),
                                          requires_grad=False)
    return layer


def _agreed(fails: str | None, device: torch.device) -> str | None:
    """Every rank's verdict: the kernels run only where they ran on every rank of the group."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return fails
    flag = torch.tensor([1 if fails else 0], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    if int(flag.item()) and fails is None:
        return "they failed on another rank of the group"
    return fails


def left_over(model: nn.Module) -> list[str]:
    """FP8 tensors of the loaded model that dequantized_fp8_linear does not multiply (grouped
    linears, which have kernels of their own only); [] when it runs them all. An FP8 embedding
    rescales the rows it looks up itself."""
    from transformers.integrations.finegrained_fp8 import (
        FP8Embedding, FP8Experts, FP8GroupedLinear, FP8Linear,
    )

    runs = (FP8Linear, FP8Experts, FP8Embedding, fp8_weights.BlockFP8Linear)
    return [f"{mname}.{pname}" if mname else pname
            for mname, m in model.named_modules()
            if not isinstance(m, runs) or isinstance(m, FP8GroupedLinear)
            for pname, p in m.named_parameters(recurse=False)
            if p.dtype in fp8_weights.FP8_DTYPES]


def use_dequantized_matmul(model: nn.Module) -> list[str]:
    """Make this process multiply FP8 weights by dequantizing them (the module's docstring);
    returns the FP8 tensors nothing then runs ([] when all are run)."""
    import transformers.integrations.finegrained_fp8 as hf_fp8

    hf_fp8.fp8_linear = dequantized_fp8_linear
    if any(isinstance(m, hf_fp8.FP8Experts) for m in model.modules()):
        # the eager loop multiplies one expert at a time through fp8_linear; grouped_mm and the
        # others call kernels of their own
        model.set_experts_implementation("eager")
    return left_over(model)


def settle_matmul(model: nn.Module, choice: str, dtype: torch.dtype,
                  device: torch.device) -> str | tuple[str, str]:
    """What multiplies a rank's kept FP8 weights (a name for the loader's note), every rank
    choosing alike; or (why, the FP8 tensors nothing runs) when some are left. ``choice`` as
    load_target's ``fp8_matmul``."""
    if choice == "transformers":
        return fp8_weights.TRANSFORMERS_MATMUL
    fails = None
    if choice == "auto":
        q = getattr(model.config, "quantization_config", None)
        block = (q.get("weight_block_size") if isinstance(q, dict)
                 else getattr(q, "weight_block_size", None))
        fails = fp8_weights.transformers_matmul_fails(
            nn.Sequential(_probe_layer(tuple(block) if block else None, device)), dtype)
    fails = _agreed(fails, device)
    if choice == "auto" and fails is None:
        return fp8_weights.TRANSFORMERS_MATMUL
    left = use_dequantized_matmul(model)
    why = ("fp8_matmul engine was asked for" if fails is None
           else f"transformers' FP8 kernels do not run here ({fails})")
    if left:
        return why, f"{len(left)} FP8 tensors such as {left[0]}"
    return f"{fp8_weights.ENGINE_MATMUL}: {why}" if fails else fp8_weights.ENGINE_MATMUL
