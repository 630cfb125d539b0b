"""Preflight's verdict on a quantized target checkpoint: whether its weights stay as stored.

transformers runs FP8 block-wise and MXFP4 weights as stored only on some devices (compute
capability, triton and kernels packages); elsewhere it dequantizes them as it loads. FP8's rule is
the loader's own (models/target/fp8.py), which also runs kept FP8 linear layers where
transformers' kernels do not load. The verdict
decides what the memory plan counts (weight_bytes.py counts the bytes), and its one line is said
before loading. Apart from the target folder's checks: it judges the devices and the installed
packages, not the config.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import re

import torch

from dflash_core.config import Config, ConfigError
from dflash_core.models.target.fp8 import (
    device_capability, expected_matmul, fp8_dequantize_reason,
)
from dflash_core.models.target.shape import model_shape
from dflash_core.planning.weight_bytes import quant_method, target_weight_bytes
from dflash_core.units import size_text


def quantized_weights(cfg: Config, hf_config: dict,
                      tdev: list[torch.device]) -> tuple[bool | None, str | None]:
    """(whether a quantized checkpoint's weights stay as stored on the target devices, the one
    line saying what they take); (None, None) for weights in a plain dtype. FP8 block-wise
    weights stay FP8 on a CUDA GPU of compute capability 8.9+ (routed experts in FP8 also need
    transformers' kernels, through the kernels package), MXFP4 (gpt-oss) experts with triton >=
    3.4 and the kernels package; elsewhere they are dequantized as they load, to the dtype the
    target runs in. Both need accelerate: without it the load would fail, so refused."""

    method = quant_method(hf_config)
    if not method:
        return None, None
    on_cuda = any(d.type == "cuda" for d in tdev)
    dtype = cfg.target.dtype if on_cuda else "float32"  # as the target stage loads it
    plain = target_weight_bytes(hf_config, dtype)
    if method not in ("fp8", "mxfp4"):
        return False, (f"target: weights quantized with {method}: the memory plan counts them "
                       f"as {dtype} ({size_text(plain)}), an upper bound")
    if importlib.util.find_spec("accelerate") is None:
        raise ConfigError("target.path", f"the target's weights are quantized ({method}): "
                          "transformers loads such checkpoints only with the accelerate package",
                          hint="pip install accelerate")
    stored = target_weight_bytes(hf_config, dtype, quantized=True)
    label = {"fp8": "FP8 block-wise", "mxfp4": "MXFP4"}[method]
    if method == "fp8":  # the loader's own rule (models/target/fp8.py)
        # in a target group the engine's FP8 matmul runs routed experts too
        # (models/target/fp8_group.py): they need transformers' kernels only in one process
        why = fp8_dequantize_reason(tdev, model_shape(hf_config).experts > 0
                                    and cfg.target.gpus_per_copy == 1)
        run_by = f", run by {expected_matmul()}"
    else:
        why, run_by = _quantized_cannot_run(method, tdev), ""
    if why is None:
        return True, (f"target: {label} weights (quant_method {method}) stay as stored: "
                      f"{size_text(stored)} ({size_text(plain)} in {dtype}){run_by}")
    return False, (f"target: the checkpoint's {label} weights cannot run here ({why}): "
                   f"transformers dequantizes them to {dtype} as it loads, {size_text(plain)} "
                   f"instead of {size_text(stored)}; the memory plan counts {dtype}")


def _quantized_cannot_run(method: str, tdev: list[torch.device]) -> str | None:
    """Why transformers would dequantize MXFP4 weights on these devices (None: it runs them as
    stored), by the checks of its quantizer."""
    gpus = [d for d in tdev if d.type == "cuda"]
    if not gpus:
        return "the target runs on the CPU"
    need = (7, 5)
    for d in gpus:
        cap = device_capability(d)
        if tuple(cap) < need:
            return (f"cuda:{d.index} has compute capability {cap[0]}.{cap[1]}, "
                    f"{method} needs {need[0]}.{need[1]}+")
    if not _installed("triton", (3, 4)):
        return "triton >= 3.4 is not installed"
    if not _installed("kernels"):
        return "the kernels package is not installed"
    return None


def _installed(package: str, at_least: tuple[int, ...] = ()) -> bool:
    """``package`` is installed, at version ``at_least`` or later (its leading numbers)."""
    try:
        version = importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return False
    numbers = tuple(int(n) for n in re.findall(r"\d+", version)[:len(at_least)])
    return numbers >= at_least
