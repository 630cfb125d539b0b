"""Preflight's checks that the run fits this machine: GPU memory and the checkpoints' disk.

The memory plan (memory.py) against each device's free memory, lowered to fit with
layout.auto_fit or refused naming the key and the sizes that would fit; and the run's
checkpoints (checkpoint/size.py) against the free disk under the run folder, refused
naming a checkpoint.keep that fits. Apart from preflight.py, which calls them with the devices
and the step count it has settled.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Callable

import psutil
import torch

from dflash_core.config import Config, ConfigError, key_value, set_key_value
from dflash_core.observe.events import Event, Log, MemoryPlan
from dflash_core.checkpoint import size as size_of
from dflash_core.checkpoint.folders import list_checkpoints
from dflash_core.planning.card_budget import card_budget, limit_bytes
from dflash_core.planning.memory import fit_sizes, plan_memory
from dflash_core.planning.memory_report import format_overflow, format_plan
from dflash_core.planning.sample_length import longest_sample
from dflash_core.units import size_text


def check_memory(cfg: Config, hf_config: dict, tdev, ddev, publish,
                 quantized: bool | None = None) -> dict[str, int]:
    """Publish the memory plan; refuse a run that cannot fit, naming the key the plan picks and
    the sizes that would fit. With layout.auto_fit, lower those sizes in ``cfg`` instead and
    return what was changed ({key: new value}). ``quantized``: quantized_weights' verdict."""
    free, total = {}, {}
    limit = limit_bytes(cfg.layout.gpu_memory_gib)
    for d in set(tdev) | set(ddev):
        if d.type == "cuda":
            f, t = torch.cuda.mem_get_info(d)
            # a rehearsed smaller card: plan for what the process will be allowed
            t = card_budget(t, limit)
            free[f"cuda:{d.index}"], total[f"cuda:{d.index}"] = min(f, t), t
        else:  # a CPU run plans against host memory (every role shares it: one "cpu" row)
            vm = psutil.virtual_memory()
            free["cpu"], total["cpu"] = vm.available, vm.total
    plan = plan_memory(cfg, hf_config, free or None, total or None, quantized)
    sizes = (fit_sizes(cfg, hf_config, free or None, total or None, quantized)
             if not plan.fits else {})
    if sizes and cfg.layout.auto_fit:
        was = {key: key_value(cfg, key) for key in sizes}
        for key, value in sizes.items():
            set_key_value(cfg, key, value)
        publish(Log(level="warning", source="preflight", message=(
            "memory plan: lowered " + ", ".join(f"{k} {was[k]} -> {v}" for k, v in sizes.items())
            + " to fit (layout.auto_fit)")))
        plan = plan_memory(cfg, hf_config, free or None, total or None, quantized)
    publish(MemoryPlan(rows=plan.to_event_rows(), fits=plan.fits))
    # How long a sample these GPUs train (a GPU plan only: on the CPU it is host memory)
    longest = (longest_sample(cfg, hf_config, free, total, quantized)
               if any(d.startswith("cuda") for d in free) else None)
    if not plan.fits:
        hint = "; ".join(format_overflow(o) for o in plan.overflows)
        if sizes:
            hint += ("; these sizes fit: " + ", ".join(f"{k}: {v}" for k, v in sizes.items())
                     + " (or set layout.auto_fit: true to pick them)")
        if longest is not None and longest < cfg.data.max_length:
            hint += (f"; samples of up to {longest} tokens fit these GPUs (data.max_length "
                     f"{cfg.data.max_length})")
        raise ConfigError(plan.key or "data.token_budget",
                          "the memory plan does not fit:\n" + format_plan(plan), hint=hint)
    if plan.recompute and cfg.drafter.recompute == "auto":
        # The replicas read the config: auto becomes on here, for this run only (a restart
        # reads the file again and plans again).
        cfg.drafter.recompute = "on"
        publish(Log(level="info", source="preflight", message=(
            "memory plan: drafter.recompute auto -> on: one sample does not fit the drafter "
            f"GPU with every layer's activations kept ({size_text(plan.without_recompute)} "
            f"planned), it does with them recomputed in backward "
            f"({size_text(max(r.total for r in plan.rows if 'drafter' in r.role))})")))
    if longest is not None:
        publish(Log(level="info", source="preflight", message=(
            f"memory plan: samples of up to {longest} tokens fit these GPUs (data.max_length "
            f"{cfg.data.max_length}, with the sizes layout.auto_fit may lower)")))
    return sizes if cfg.layout.auto_fit else {}


def check_checkpoint_disk(cfg: Config, hf_config: dict, run_dir: Path, total_steps: int,
                          publish: Callable[[Event], None]) -> None:
    """Say what the run's checkpoints take (served weights, float32 master weights, optimizer
    state; checkpoint.keep of them plus the one being written) against the free space under the
    run folder; refuse a run whose checkpoints cannot fit, naming a checkpoint.keep that does."""
    params, matrices = size_of.drafter_counts(cfg, hf_config)
    size = size_of.checkpoint_bytes(params, matrices, getattr(torch, cfg.drafter.dtype).itemsize,
                                    cfg.optim.name, size_of.frozen_count(cfg, hf_config))
    planned = size_of.planned_checkpoints(cfg.checkpoint.every, total_steps)
    existing = len(list_checkpoints(run_dir))
    best = bool(cfg.eval.every and (cfg.data.eval_prompts or cfg.eval.best_set))
    need = size_of.disk_need(size, cfg.checkpoint.keep, planned, existing, best)
    free = shutil.disk_usage(run_dir).free
    said = f"{need.describe()}; {size_text(free)} free under {run_dir}"
    if free >= need.bytes:
        publish(Log(level="info", source="preflight", message=f"checkpoints: {said}"))
        return
    keep = size_of.keep_that_fits(size, free, planned, existing, best)
    if keep:
        hint = (f"set checkpoint.keep: {keep} (needs "
                f"{size_text(size_of.disk_need(size, keep, planned, existing, best).bytes)}),"
                " free disk space, or point run.output_dir at a disk with room")
    else:
        hint = "free disk space, or point run.output_dir at a disk with room"
    raise ConfigError("checkpoint.keep" if keep else "run.output_dir",
                      f"the run's checkpoints do not fit: {said}", hint=hint)
