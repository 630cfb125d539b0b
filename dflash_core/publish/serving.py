"""The serving command lines of a published drafter, per family. They follow vLLM's and SGLang's
public documentation of speculative decoding; the options beyond the draft model and its token
counts vary between versions of those stacks, whose documentation is the reference.

The token counts come from the family (families/registry: drafts_per_round): a DFlash block of B
inputs drafts B-1 tokens (vLLM's num_speculative_tokens), and SGLang counts the block, B; a
DSpark block of B inputs drafts B tokens (its anchor slot predicts too). DFlash2 is served by
vLLM as DFlash is (the method "dflash"; the architecture DFlash2DraftModel selects its
convolutions and selector), B-1 drafts; it gets no SGLang line: SGLang's DFlash model has no
convolutions and no candidate selector (SGLANG_NO_DFLASH2 says so on the card).
"""

from __future__ import annotations

import json
import shlex
from typing import NamedTuple


# What the card says instead of an SGLang command for a DFlash2 folder.
SGLANG_NO_DFLASH2 = (
    "SGLang: no command is given. SGLang's DFlash model (`--speculative-algorithm DFLASH`) has "
    "no convolutions and no candidate selector: it would draft from this folder's backbone "
    "alone, not what the drafter was trained to draft. SGLang's own DFlash2 support came after "
    "its v0.5.18 release and has not been checked against this format; serve it with vLLM as "
    "above.")


class Serving(NamedTuple):
    vllm: str
    sglang: str | None  # None: SGLang does not serve the family (DFlash2)


def command_lines(objective: str, target: str, model: str, block_size: int,
                  drafts_per_round: int) -> Serving:
    """vLLM's and SGLang's command lines serving ``target`` with the drafter at ``model`` (no
    SGLang line for DFlash2)."""
    # DFlash2 is served by vLLM's DFlash method (its architecture picks the selector; only the
    # V2 GPU model runner has it) and needs num_speculative_tokens = B - 1: vLLM does not read
    # the block size from config.json.
    method = {"dflash": "dflash", "dspark": "dspark", "dflash2": "dflash"}[objective]
    spec = json.dumps({"method": method, "model": model,
                       "num_speculative_tokens": drafts_per_round})
    target, model = shlex.quote(target), shlex.quote(model)
    vllm = f"vllm serve {target} \\\n  --speculative-config {shlex.quote(spec)}"
    if objective == "dflash2":
        return Serving(vllm, None)
    sglang = (f"python -m sglang.launch_server --model-path {target} \\\n"
              f"  --speculative-algorithm {method.upper()} \\\n"
              f"  --speculative-draft-model-path {model}")
    if method == "dflash":
        sglang += f" \\\n  --speculative-num-draft-tokens {block_size}"
    return Serving(vllm, sglang)
