"""Preflight: everything that can be checked before tens of GB of weights load.

Devices, disk space, wandb settings against the installed wandb, the target folder (its own code,
its layer ids and mask id, the attention implementation its class can run, its quantized weights
against the devices), the evaluation's prompt sets (eval.prompt_sets: files, chat template), the
data shards and their batch plan, and the memory plan per GPU. Any
problem is a ConfigError / DataError naming the key or file and the fix, raised before a single
weight loads.

The checks live by what they check (target_checks.py, drafter_checks.py, attention_choice.py,
quantized_check.py, data_checks.py, capacity_checks.py); this module resolves the devices and
runs the checks in their order (prepare), handing the run what they found (Prepared).
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from dflash_core.eval.run_sets import prepare_sets
from dflash_core.config import Config, ConfigError
from dflash_core.data import BatchStream, ShardedDataset, split_eval
from dflash_core.data.provenance import of_manifest
from dflash_core.models.training.optimizers import muon_class
from dflash_core.models.training.trainer import epoch_steps_for, total_steps_for
from dflash_core.observe.events import BuildProgress, Event, Log
from dflash_core.observe.sinks.wandb_sink import validate_wandb_settings
from dflash_core.persist.build_cache import Progress
from dflash_core.planning.capacity_checks import check_checkpoint_disk, check_memory
from dflash_core.planning.drafter_checks import check_fused_loss, fused_loss_line
from dflash_core.planning.data_checks import (
    check_data_manifest, check_something_trains, resolve_data,
)
from dflash_core.planning.quantized_check import quantized_weights
from dflash_core.planning.target_checks import resolve_target
from dflash_core.units import size_text

MIN_FREE_DISK = 64 << 20  # the demo's assets and the run's records need this much to start


def resolve_devices(cfg: Config) -> tuple[list[torch.device], list[torch.device]]:
    """Target and drafter devices; on CPU every worker is a logical one on the same device."""
    kind = cfg.layout.device
    if kind == "auto":
        kind = "cuda" if torch.cuda.is_available() else "cpu"
    if kind == "cpu":
        return ([torch.device("cpu")] * len(cfg.layout.targets),
                [torch.device("cpu")] * len(cfg.layout.drafters))
    if not torch.cuda.is_available():
        raise ConfigError("layout.device", "cuda requested but no CUDA device is visible",
                          hint="set layout.device: cpu, or check CUDA_VISIBLE_DEVICES")
    n = torch.cuda.device_count()
    for key, ids in (("layout.targets", cfg.layout.targets),
                     ("layout.drafters", cfg.layout.drafters)):
        bad = [i for i in ids if not 0 <= i < n]
        if bad:
            raise ConfigError(key, f"GPU(s) {bad} not present; this machine has {n} "
                              f"(0..{n - 1})", hint=f"use GPU indices 0..{n - 1} in {key}")
    return ([torch.device(f"cuda:{i}") for i in cfg.layout.targets],
            [torch.device(f"cuda:{i}") for i in cfg.layout.drafters])


def device_label(dev: torch.device, i: int) -> str:
    return f"cuda:{dev.index}" if dev.type == "cuda" else f"cpu:{i}"


@dataclass
class Prepared:
    """What preflight found, for the run to use."""

    target_path: Path
    layer_ids: list[int]
    mask_id: int
    dataset: Any  # data.ShardedDataset
    eval_indices: np.ndarray
    stream: Any  # data.BatchStream
    total_steps: int
    fitted: dict = field(default_factory=dict)  # sizes layout.auto_fit lowered {key: new value}
    epoch_steps: int = 0  # the steps optim.epochs make; total_steps is less when max_steps is
    eval_sets: list = field(default_factory=list)  # eval.prompt_sets rendered (run_sets.RunSet)
    # where the data's responses came from (the manifest's; data/provenance.py): the data
    # finding's words
    provenance: dict | None = None


def check_group(cfg: Config, hf_config: dict, publish: Callable[[Event], None]) -> None:
    """A target copy over several GPUs (target.gpus_per_copy): what transformers cannot split,
    refused before any weight is read; the split said once."""
    from dflash_core.models.target.shape import model_shape
    from dflash_core.planning.weight_bytes import quant_method
    from dflash_core.target_group.fp8_split import check_fp8_split
    from dflash_core.target_group.split import (
        check_split, check_transformers, copies, split_of,
    )

    split = split_of(cfg.target)
    if split.k == 1:
        return
    shape = model_shape(hf_config)
    moe = shape.experts > 0
    check_split(split, shape, quant=quant_method(hf_config))
    check_transformers(split, moe, shape.model_type)
    check_fp8_split(split, shape, hf_config)
    groups = copies(cfg.layout.targets, split.k)
    publish(Log(level="info", source="preflight", message=(
        f"target groups: {len(groups)} cop{'y' if len(groups) == 1 else 'ies'} of the target, "
        f"each over {split.k} GPUs {groups}, {split.describe(moe)}; "
        f"{len(groups) * split.producers} batch stream(s)")))


def prepare(cfg: Config, run_dir: Path, tdev: list[torch.device], ddev: list[torch.device], *,
            publish: Callable[[Event], None], demo_progress: Callable[[str], Progress],
            nodes: int = 1, checkpoints: bool = True) -> Prepared:
    """``nodes``: the nodes of the run, each with the drafters of ``ddev`` (the steps of the
    plan count every node's drafters). ``checkpoints``: this process writes the run's
    checkpoints (one node, or node 0 of several), so its disk must hold them."""
    free = shutil.disk_usage(run_dir).free
    if free < MIN_FREE_DISK:
        raise ConfigError("run.output_dir", f"only {size_text(free)} free in {run_dir}",
                          hint="free disk space or point run.output_dir elsewhere")
    if cfg.optim.name == "muon":  # before tens of GB of weights load, not at the first step
        muon_class()
    check_fused_loss(cfg, ddev)
    if cfg.wandb.enabled:
        validate_wandb_settings(cfg.wandb.settings)

    def warn(message: str) -> None:
        publish(Log(level="warning", source="preflight", message=message))

    if any(d.type == "cuda" for d in ddev):  # which loss the drafters run, said once
        publish(Log(level="info", source="preflight", message=fused_loss_line(cfg)))

    target_path, hf_config, layer_ids, mask_id = resolve_target(cfg, run_dir, demo_progress,
                                                                say=warn)
    # the evaluating process's prompt sets: their files and the chat template, before weights
    eval_sets = prepare_sets(cfg.eval, target_path, cfg.target.path,
                             cfg.target.trust_remote_code) if checkpoints else []
    kept, said = quantized_weights(cfg, hf_config, tdev)
    if said:
        publish(Log(level="info" if kept else "warning", source="preflight", message=said))
    check_group(cfg, hf_config, publish)
    # Before the data is planned: layout.auto_fit may lower data.token_budget.
    fitted = check_memory(cfg, hf_config, tdev, ddev, publish, quantized=kept)

    data_path = resolve_data(cfg, target_path, demo_progress)
    provenance = of_manifest(check_data_manifest(cfg, data_path, target_path))
    dataset = ShardedDataset.open(data_path)
    n_eval = min(cfg.data.eval_prompts, max(0, len(dataset) - 1))
    _, eval_indices = split_eval(len(dataset), n_eval, cfg.run.seed)
    stream = BatchStream.from_config(dataset, cfg.data, seed=cfg.run.seed,
                                     epochs=cfg.optim.epochs, exclude=eval_indices,
                                     step_batches=len(ddev) * nodes * cfg.optim.grad_accum,
                                     anchors=cfg.drafter.num_anchors,
                                     per_1k=cfg.drafter.anchors_per_1k_tokens)
    if stream.batches_per_epoch == 0:
        raise ConfigError("data.path", f"no trainable batch in {data_path}",
                          hint="the data needs samples of 2+ tokens")
    check_something_trains(dataset, data_path)
    world = len(ddev) * nodes
    total_steps = total_steps_for(cfg.optim, cfg.run.max_steps, stream.batches_per_epoch, world)
    if checkpoints:
        check_checkpoint_disk(cfg, hf_config, run_dir, total_steps, publish)
    return Prepared(target_path, layer_ids, mask_id, dataset, eval_indices, stream, total_steps,
                    fitted, epoch_steps_for(cfg.optim, stream.batches_per_epoch, world),
                    eval_sets, provenance)


def demo_log_progress(publish: Callable[[Event], None], stop_check: Callable[[], None]):
    """Progress callbacks for building the demo assets: a BuildProgress at each new whole
    percent (the dashboard shows it where the targets will be), a Log line every 10%."""
    def for_what(what: str) -> Progress:
        last = [-1.0]
        shown = [-1]

        def report(fraction: float, message: str = "") -> None:
            stop_check()
            percent = int(100 * fraction)
            if percent > shown[0] or fraction >= 1.0:
                shown[0] = percent
                publish(BuildProgress(what=what, fraction=fraction, message=message))
            if fraction - last[0] >= 0.1 or fraction >= 1.0:
                last[0] = fraction
                publish(Log(level="info", source="demo",
                            message=f"{what}: {fraction:.0%} {message}".rstrip()))
        return report
    return for_what
