"""An FP8 block-wise target under tensor parallel (target.parallel: shared): every slice a rank
holds must be a whole number of the checkpoint's blocks, checked before the split is chosen.

A block-wise checkpoint keeps one scale per ``weight_block_size`` block (128 x 128 as published).
transformers shards a weight and its ``weight_scale_inv`` grid alike along the dimension its
tensor-parallel plan splits (the output of a colwise layer, the input of a rowwise one), so a
rank's rows line up with its scales only where the split width over k is a multiple of the block:
Qwen3-style attention with 2 x 64-wide key/value heads over 2 GPUs holds 64 rows per rank beside
no whole scale row, and the load fails (vLLM refuses the same splits, naming block_n / block_k).
The check reads the splits from transformers' own plan for the model class, resolved on a model
built on the meta device (no memory, no weights), so it sees what the load will split.

Sharded mode (FSDP) gathers each weight whole before its layer runs and expert parallel moves
whole experts: neither cuts a block, so neither is checked.
"""

from __future__ import annotations

import contextlib
import re
from dataclasses import dataclass
from typing import Callable

from dflash_core.config.errors import ConfigError
from dflash_core.models.target.shape import ModelShape
from dflash_core.planning.weight_bytes import quantization
from dflash_core.target_group.split import SHARED, GroupSplit

# transformers' tensor-parallel styles by the weight dimension they split (each rank one slice of
# it); the others replicate the weight (mla_kv_a_proj, all_reduce, replicate, ...). "packed"
# styles split each of a fused weight's halves.
SPLITS_OUT = {"colwise": 1, "colwise_gather_output": 1, "colwise_rep": 1, "unit_colwise": 1,
              "packed_colwise": 2}
SPLITS_IN = {"rowwise": 1, "rowwise_split_input": 1, "rowwise_rep": 1, "unit_rowwise": 1,
             "packed_rowwise": 2}


@dataclass(frozen=True)
class SplitDim:
    """One weight dimension the tensor-parallel plan splits: the layer (its layer number as *),
    which dimension, its width, and the parts it is packed of."""

    layer: str
    dim: str  # "output" | "input"
    width: int
    parts: int = 1

    def per_rank(self, k: int) -> float:
        return self.width / self.parts / k

    def whole_blocks(self, k: int, block: int) -> bool:
        share = self.width // self.parts
        return share % k == 0 and (share // k) % block == 0


def fp8_block(hf_config: dict) -> tuple[int, int] | None:
    """(rows, columns) of an FP8 checkpoint's scale blocks; None for a per-tensor scale or a
    checkpoint that is not FP8."""
    q = quantization(hf_config)
    block = q.get("weight_block_size") if q.get("quant_method") == "fp8" else None
    return (int(block[0]), int(block[1])) if block else None


@contextlib.contextmanager
def _quiet_transformers():
    """transformers warns on stderr about plan rules naming no module of this class (the
    dashboard's terminal): errors only, while the plan is read."""
    from transformers.utils import logging as hf_logging
    before = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(before)


def tensor_parallel_splits(hf_config: dict, distributed: dict) -> list[SplitDim] | None:
    """The FP8 weight dimensions transformers' tensor-parallel plan splits for ``distributed``
    (DistributedConfig's fields), one per layer name; None when transformers does not know the
    model type (a model of its own code: its own plan, read only at load)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.distributed import DistributedConfig
    from transformers.quantizers.quantizers_utils import should_convert_module

    plain = {k: v for k, v in hf_config.items() if k != "quantization_config"}
    if isinstance(plain.get("text_config"), dict):
        plain["text_config"] = {k: v for k, v in plain["text_config"].items()
                                if k != "quantization_config"}
    skip = list(quantization(hf_config).get("modules_to_not_convert") or [])
    with _quiet_transformers():
        try:
            config = AutoConfig.for_model(**plain)
        except (ValueError, KeyError):
            return None
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
        # the plan from_pretrained applies (its overrides merged, `*` expanded per layer)
        tp_plan, _, _ = model._resolve_parallel_plans(DistributedConfig(**distributed))
    modules = dict(model.named_modules())
    head = model.get_output_embeddings()
    found: dict[tuple[str, str], SplitDim] = {}
    for name, style in tp_plan.items():
        m = modules.get(name)
        # FP8 layers: transformers converts the plain linear layers but the lm_head and what the
        # checkpoint names unconverted
        if (type(m) is not torch.nn.Linear or m is head
                or not should_convert_module(name, skip)):
            continue
        layer = re.sub(r"\.\d+\.", ".*.", name)
        if style in SPLITS_OUT:
            found[(layer, "output")] = SplitDim(layer, "output", m.out_features,
                                                SPLITS_OUT[style])
        elif style in SPLITS_IN:
            found[(layer, "input")] = SplitDim(layer, "input", m.in_features, SPLITS_IN[style])
    return list(found.values())


def check_fp8_tensor_parallel(k: int, hf_config: dict, distributed: dict,
                              sizes_ok: Callable[[int], bool] = lambda n: True) -> None:
    """Refuse a tensor-parallel split of an FP8 block-wise target that cuts a block (ConfigError
    naming the layer, the dimension, the block and k, and a smaller size that would not).
    ``sizes_ok``: whether another size passes the other checks of a split (heads, experts), for
    the hint."""
    block = fp8_block(hf_config)
    if block is None or k == 1:
        return
    splits = tensor_parallel_splits(hf_config, distributed)
    if not splits:
        return

    def cuts(size: int) -> list[SplitDim]:
        return [s for s in splits
                if not s.whole_blocks(size, block[0] if s.dim == "output" else block[1])]

    bad = cuts(k)
    if not bad:
        return
    first = bad[0]
    width = (f"{first.width} {first.dim} columns" if first.dim == "input"
             else f"{first.width} output rows")
    packed = f" ({first.parts} packed parts)" if first.parts > 1 else ""
    others = (f" (and {len(bad) - 1} more layer{'s' if len(bad) > 2 else ''})"
              if len(bad) > 1 else "")
    fine = [n for n in range(2, k) if not cuts(n) and sizes_ok(n)]  # smaller copies
    size_hint = (f", or target.gpus_per_copy: {max(fine)} (every split a whole number of "
                 "blocks)" if fine else "")
    raise ConfigError("target.gpus_per_copy", (
        f"tensor parallel over {k} GPUs splits {first.layer}'s {width}{packed} into "
        f"{first.per_rank(k):g} per GPU, not a multiple of the FP8 checkpoint's "
        f"{block[0]} x {block[1]} blocks{others}"),
        hint="set target.parallel: sharded (FSDP gathers each weight whole, cutting no block)"
             + size_hint)


def check_fp8_split(split: GroupSplit, shape: ModelShape, hf_config: dict) -> None:
    """Preflight's check of a group's split of an FP8 block-wise target: a shared (tensor
    parallel) split cuts no block; the sizes the hint may suggest pass split.check_split's
    divisibility rules too."""
    if split.k == 1 or split.mode != SHARED or fp8_block(hf_config) is None:
        return

    def divides(n: int) -> bool:
        return all(c % n == 0 for c in (shape.heads, shape.kv_heads, shape.intermediate,
                                          shape.experts) if c)
    check_fp8_tensor_parallel(split.k, hf_config, split.distributed(shape.experts > 0), divides)
