"""``dflash-tui eval`` with the target as a target group (``--gpus-per-copy K``): the split and its
GPUs checked before anything loads (the run's refusals, in the flags' words), then the target
loaded over its ranks (target_group/session.py) and decoded through them. The drafters stay on
``--device``.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from dflash_core.config.errors import ConfigError
from dflash_core.eval.errors import EvalInputError
from dflash_core.target_group.split import SHARDED, SHARED, GroupSplit

# The config's words in the split's refusals, as eval's flags say them
_FLAGS = [
    (r"target\.gpus_per_copy: (\d+)", r"--gpus-per-copy \1"),
    (r"target\.gpus_per_copy", "--gpus-per-copy"),
    (r"target\.parallel: (\w+)", r"--parallel \1"),
    (r"target\.parallel", "--parallel"),
    (r"target\.expert_parallel: true", "--expert-parallel on"),
    (r"target\.expert_parallel: false", "--expert-parallel off"),
    (r"target\.expert_parallel", "--expert-parallel"),
    (r"point target\.path at", "pass --target"),
    (r"(--[\w-]+) to a divisor", r"\1 a divisor"),
    (r"\bset --", "pass --"),
    (r"\bor --", "or pass --"),
]


def in_flags(text: str) -> str:
    for pattern, flag in _FLAGS:
        text = re.sub(pattern, flag, text)
    return text


@dataclass(frozen=True)
class GroupPlan:
    """The group eval loads: its split and the devices of its ranks."""

    split: GroupSplit
    devices: list[torch.device]
    moe: bool  # a mixture-of-experts target (experts split by expert parallel)

    def describe(self) -> str:
        return (f"a target group of {self.split.k} ranks on "
                f"{', '.join(str(d) for d in self.devices)}, {self.split.describe(self.moe)}")


def parse_gpus(spec: str) -> list[int]:
    try:
        gpus = [int(p) for p in spec.split(",") if p.strip()]
    except ValueError:
        raise EvalInputError(f"--target-gpus {spec!r}: not a list of GPU indices",
                             hint="pass GPU indices separated by commas, e.g. 0,1,2,3") from None
    if len(set(gpus)) != len(gpus) or any(g < 0 for g in gpus):
        raise EvalInputError(f"--target-gpus {spec}: each GPU once, indices from 0",
                             hint="pass distinct GPU indices, e.g. 0,1,2,3")
    return gpus


def check_engine(k: int, engine: str) -> None:
    """vLLM serves the target on one GPU here: refused with a group (before vLLM is looked
    for)."""
    if k > 1 and engine != "ours":
        raise EvalInputError(f"--engine {engine} with --gpus-per-copy {k}: vLLM is run on one "
                             "GPU here", hint="leave --engine out (ours decodes through the "
                                              "target group), or pass --gpus-per-copy 1")


def plan_group(k: int, gpus: str, parallel: str, expert_parallel: bool, device: torch.device,
               folder: Path) -> GroupPlan | None:
    """The group ``--gpus-per-copy k`` asks for (None: k = 1, the target whole on --device),
    or one EvalInputError naming the flag to change."""
    if k < 1:
        raise EvalInputError(f"--gpus-per-copy {k}: must be >= 1")
    if k == 1:
        if gpus:
            raise EvalInputError("--target-gpus names the GPUs of a target group: it needs "
                                 "--gpus-per-copy 2 or more",
                                 hint="pass --gpus-per-copy K with K GPUs, or leave "
                                      "--target-gpus out")
        return None
    if parallel not in (SHARDED, SHARED):
        raise EvalInputError(f"--parallel {parallel!r}: use sharded or shared")
    if device.type == "cpu":
        if gpus:
            raise EvalInputError("--target-gpus names GPUs: on the CPU a group's ranks are "
                                 "processes of this machine", hint="leave --target-gpus out "
                                                                   "with --device cpu")
        devices = [torch.device("cpu")] * k
    else:
        ids = parse_gpus(gpus) if gpus else list(range(k))
        if len(ids) != k:
            raise EvalInputError(f"--target-gpus {gpus}: {len(ids)} GPU(s) for a copy of "
                                 f"--gpus-per-copy {k}", hint=f"list {k} GPUs in --target-gpus")
        n = torch.cuda.device_count()
        bad = [i for i in ids if i >= n]
        if bad:
            raise EvalInputError(f"--target-gpus: GPU(s) {bad} not present; this machine has "
                                 f"{n}", hint=f"use GPU indices 0..{n - 1} in --target-gpus")
        devices = [torch.device("cuda", i) for i in ids]
    split = GroupSplit(k, parallel, expert_parallel)
    return GroupPlan(split, devices, check(split, folder))


def check(split: GroupSplit, folder: Path) -> bool:
    """What transformers cannot split this way (target_group/split.py): one line. Returns
    whether the target is a mixture of experts."""
    from dflash_core.models.target.shape import model_shape
    from dflash_core.planning.weight_bytes import quant_method
    from dflash_core.target_group.fp8_split import check_fp8_split
    from dflash_core.target_group.split import check_split, check_transformers

    raw = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    shape = model_shape(raw)
    try:
        quant = quant_method(raw)
        check_split(split, shape, quant=quant)
        if quant == "fp8":
            check_fp8_split(split, shape, raw)
        check_transformers(split, shape.experts > 0, shape.model_type)
    except ConfigError as exc:
        raise EvalInputError(f"{in_flags(exc.key)} {_value(split, exc.key)}: "
                             f"{in_flags(exc.message)}", hint=in_flags(exc.hint)) from exc
    return shape.experts > 0


def _value(split: GroupSplit, key: str) -> str:
    return {"target.gpus_per_copy": str(split.k), "target.parallel": split.mode,
            "target.expert_parallel": "on" if split.expert_parallel else "off"}.get(key, "")
