"""Preflight's choice of target.attn_implementation against the class transformers will build.

Apart from the target folder's other checks (target_checks.py) because it is a decision, not only a
check: sdpa on a class without it becomes eager, with one line saying so; an implementation the
class cannot run (or flash_attention_2 without CUDA and flash_attn) is refused with the ones
that work, before the weights load rather than after.
"""

from __future__ import annotations

import importlib.util
from typing import Callable

import torch

from dflash_core.config import Config, ConfigError
from dflash_core.models.target.shape import model_shape
from dflash_core.models.target.config import causal_lm_class


# What transformers knows by these names; others (a Hub kernel such as
# "kernels-community/vllm-flash-attn3") are left for transformers to judge at load.
KNOWN_ATTENTION = {"eager": None, "sdpa": "_supports_sdpa",
                   "flash_attention_2": "_supports_flash_attn",
                   "flash_attention_3": "_supports_flash_attn",
                   "flex_attention": "_supports_flex_attn"}


def attention_choices(model_class) -> list[str]:
    """The attention implementations among KNOWN_ATTENTION that a transformers model class
    declares it can run (eager always)."""
    return [name for name, flag in KNOWN_ATTENTION.items()
            if flag is None or getattr(model_class, flag, False)]


def choose_attention(cfg: Config, hf_config: dict, say: Callable[[str], None]) -> None:
    """Settle target.attn_implementation against the class transformers will build: one it
    cannot run is found here, not when the weights have loaded. sdpa (the default) on a class
    without it (gpt-oss: SDPA has no attention sinks) becomes eager, which every class runs, and
    ``say`` says so; any other is refused with the ones that work. flash_attention_2 needs CUDA
    and the flash_attn package. A model of remote code is left to its code."""
    wanted = cfg.target.attn_implementation
    model_class = causal_lm_class(hf_config)
    if model_class is None or wanted not in KNOWN_ATTENTION:
        return
    choices = attention_choices(model_class)
    if model_shape(hf_config).attn_sinks:
        # transformers passes gpt-oss's sinks only to kernels that take them (vllm's FA3 from the
        # Hub, FA4); the flash_attn packages drop them without a word: other features than the
        # model's own.
        choices = [c for c in choices if c not in ("flash_attention_2", "flash_attention_3")]
    if wanted == "flash_attention_2" and "flash_attention_2" in choices:
        on_cpu = cfg.layout.device == "cpu" or not torch.cuda.is_available()
        if on_cpu or importlib.util.find_spec("flash_attn") is None:
            raise ConfigError("target.attn_implementation", "flash_attention_2 needs CUDA and "
                              "the flash_attn package" + (
                                  "; this run is on the CPU" if on_cpu
                                  else "; flash_attn is not installed"),
                              hint="set target.attn_implementation: sdpa (or install flash-attn "
                                   "on a CUDA machine)")
    if wanted in choices:
        return
    name = model_class.__name__
    if wanted == "sdpa":
        cfg.target.attn_implementation = "eager"
        other = (" (flex_attention also runs it: set target.attn_implementation: "
                 "flex_attention to try it)" if "flex_attention" in choices else "")
        say(f"target.attn_implementation: {name} cannot run sdpa (transformers: no SDPA path "
            f"for its attention); using eager, which holds each sequence's attention scores "
            f"(the memory plan counts them){other}")
        return
    sinks = (" (the flash_attn package drops its attention sinks)"
             if wanted.startswith("flash_attention") and wanted in attention_choices(model_class)
             else "")
    raise ConfigError("target.attn_implementation", f"{name} cannot run {wanted!r}{sinks}",
                      hint=f"set target.attn_implementation to one of {choices}")
