"""How one copy of the target is split over the GPUs of a group, in transformers' terms, and the
splits preflight refuses (each one line, naming the key to change).

Two modes (target.parallel):
- sharded: FSDP over the copy's GPUs, the experts of a mixture-of-experts target split between
  them too (expert parallel). Every rank takes its own batches, so to the rest of the engine each
  rank is one target worker.
- shared: tensor parallel (with expert parallel on a MoE target): every rank runs the same batch
  and rank 0 hands the features off, so the whole copy is one target worker.

Under either the residual stream is whole on every rank, so the captured layer outputs are plain
full-width tensors (measured within 1.3e-6 of one process, fp32).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from typing import TYPE_CHECKING

from dflash_core.config.errors import ConfigError

if TYPE_CHECKING:
    from dflash_core.models.target.shape import ModelShape

SHARDED, SHARED = "sharded", "shared"


@dataclass(frozen=True)
class GroupSplit:
    """One copy's split: its size ``k``, the mode, and whether experts are split."""

    k: int
    mode: str
    expert_parallel: bool

    @property
    def producers(self) -> int:
        """Batch streams a copy takes: each rank its own (sharded), or one for all (shared)."""
        return self.k if self.mode == SHARDED else 1

    def distributed(self, moe: bool) -> dict:
        """The ``DistributedConfig`` fields for this split."""
        ep = {"ep_size": self.k} if moe and self.expert_parallel else {}
        if self.mode == SHARDED:
            return {"tp_size": 1, "fsdp_size": self.k, **ep}
        return {"tp_size": self.k, **ep}

    def describe(self, moe: bool) -> str:
        d = self.distributed(moe)
        parts = [f"{k.removesuffix('_size')} {v}" for k, v in d.items() if v > 1]
        return f"{self.mode} ({', '.join(parts)})"


def split_of(target_cfg) -> GroupSplit:
    """The config's target section as a split (k = target.gpus_per_copy)."""
    return GroupSplit(target_cfg.gpus_per_copy, target_cfg.parallel, target_cfg.expert_parallel)


def copies(devices: list, k: int) -> list[list]:
    """layout.targets cut into copies of ``k`` consecutive entries."""
    return [devices[i:i + k] for i in range(0, len(devices), k)]


def check_split(split: GroupSplit, shape: ModelShape, *, quant: str | None = None) -> None:
    """What transformers cannot split this way, or would split uselessly: one ConfigError each.
    ``quant``: the checkpoint's quant_method (None for plain weights); FP8 block-wise splits are
    checked further by fp8_split.check_fp8_split."""
    if split.k == 1:
        return
    k, moe = split.k, shape.experts > 0
    if quant and quant != "fp8":
        raise ConfigError("target.gpus_per_copy", (
            f"a target quantized with {quant} in a group of several GPUs is not supported (FP8 "
            "block-wise ones are)"), hint="set target.gpus_per_copy: 1, or point target.path "
                                          "at a bf16 or FP8 block-wise copy of the model")
    if split.mode == SHARED and moe and not split.expert_parallel:
        raise ConfigError("target.expert_parallel", (
            f"tensor parallel alone leaves all {shape.experts} experts of this mixture-of-experts "
            f"target on every one of the {k} GPUs"),
            hint="set target.expert_parallel: true (experts split between the GPUs), or "
                 "target.parallel: sharded")
    if moe and split.expert_parallel and shape.experts % k:
        raise ConfigError("target.gpus_per_copy", (
            f"{shape.experts} experts do not split evenly over {k} GPUs"),
            hint=f"set target.gpus_per_copy to a divisor of {shape.experts}")
    if split.mode == SHARED:
        for name, n in (("attention heads", shape.heads), ("key/value heads", shape.kv_heads),
                        ("MLP width", shape.intermediate)):
            if n and n % k:
                raise ConfigError("target.gpus_per_copy", (
                    f"tensor parallel over {k} GPUs: the target's {n} {name} do not divide by "
                    f"{k}"), hint=f"set target.gpus_per_copy to a divisor of {n}, or "
                                  "target.parallel: sharded")


def check_transformers(split: GroupSplit, moe: bool, model_type: str) -> None:
    """The installed transformers can make this split: DistributedConfig with the fields the
    split uses, and the model class's plan for tensor / expert parallel."""
    if split.k == 1:
        return
    import transformers
    try:
        from transformers.distributed import DistributedConfig
    except ImportError:
        DistributedConfig = None
    fields = ({f.name for f in dataclasses.fields(DistributedConfig)}
              if DistributedConfig is not None else set())
    need = set(split.distributed(moe))
    if not need <= fields:
        raise ConfigError("target.gpus_per_copy", (
            f"transformers {transformers.__version__} cannot split a target {split.describe(moe)}"
            f" (its DistributedConfig lacks {sorted(need - fields)})"),
            hint="pip install 'transformers>=5.21' (expert parallel as ep_size), or set "
                 "target.gpus_per_copy: 1")
    from transformers import AutoConfig
    try:
        cls = type(AutoConfig.for_model(model_type))
    except (ValueError, KeyError):
        return  # remote code: transformers says itself what it cannot split
    if split.mode == SHARED and not getattr(cls, "base_model_tp_plan", None):
        raise ConfigError("target.parallel", (
            f"transformers has no tensor-parallel plan for {model_type}: every GPU would hold "
            "the whole model"), hint="set target.parallel: sharded")
    if moe and split.expert_parallel and not getattr(cls, "base_model_ep_plan", None):
        raise ConfigError("target.expert_parallel", (
            f"transformers has no expert-parallel plan for {model_type}"),
            hint="set target.expert_parallel: false with target.parallel: sharded")
