"""Preflight: everything that can be checked before tens of GB of weights load.

Devices, disk space, wandb settings against the installed wandb, the target folder (its own code,
its layer ids and mask id, the attention implementation its class can run, its quantized weights
against the devices), the evaluation's prompt sets (eval.prompt_sets: files, chat template), the
data shards and their batch plan, and the memory plan per GPU. Any
problem is a ConfigError / DataError naming the key or file and the fix, raised before a single
weight loads.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
import psutil
import torch
from transformers import AutoTokenizer

from dflash_core import demo
from dflash_core.bench_eval.run_sets import prepare_sets
from dflash_core.config import Config, ConfigError, key_value, set_key_value
from dflash_core.data import BatchStream, ShardedDataset, split_eval
from dflash_core.data.byte_vocab import byte_tokenizer
from dflash_core.data.chat_render import template_fingerprint, tokenizer_fingerprint
from dflash_core.data.manifest import check_data_folder, read_manifest
from dflash_core.models import drafter_kinds
from dflash_core.models.model_shape import model_shape
from dflash_core.models.optimizers import muon_class
from dflash_core.models.target import (
    REMOTE_CODE_HINT, causal_lm_class, default_layer_ids, needs_remote_code, remote_code_refusal,
)
from dflash_core.models.trainer import epoch_steps_for, total_steps_for
from dflash_core.observe.events import Event, Log, MemoryPlan
from dflash_core.observe.sinks.wandb_sink import validate_wandb_settings
from dflash_core.persist import checkpoint_size as size_of
from dflash_core.persist.build_cache import Progress
from dflash_core.persist.checkpoint_folders import list_checkpoints
from dflash_core.persist.checksums import verify
from dflash_core.planning.card_budget import card_budget, limit_bytes
from dflash_core.planning.memory import fit_sizes, plan_memory
from dflash_core.planning.weight_bytes import quant_method, target_weight_bytes
from dflash_core.planning.memory_report import format_overflow, format_plan
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
    if cfg.wandb.enabled:
        validate_wandb_settings(cfg.wandb.settings)

    def warn(message: str) -> None:
        publish(Log(level="warning", source="preflight", message=message))

    target_path, hf_config, layer_ids, mask_id = resolve_target(cfg, run_dir, demo_progress,
                                                                say=warn)
    # the evaluating process's prompt sets: their files and the chat template, before weights
    eval_sets = prepare_sets(cfg.eval, target_path, cfg.target.path,
                             cfg.target.trust_remote_code) if checkpoints else []
    kept, said = quantized_weights(cfg, hf_config, tdev)
    if said:
        publish(Log(level="info" if kept else "warning", source="preflight", message=said))
    # Before the data is planned: layout.auto_fit may lower data.token_budget.
    fitted = check_memory(cfg, hf_config, tdev, ddev, publish, quantized=kept)

    data_path = resolve_data(cfg, target_path, demo_progress)
    check_data_manifest(cfg, data_path, target_path)
    dataset = ShardedDataset.open(data_path)
    n_eval = min(cfg.data.eval_prompts, max(0, len(dataset) - 1))
    _, eval_indices = split_eval(len(dataset), n_eval, cfg.run.seed)
    stream = BatchStream.from_config(dataset, cfg.data, seed=cfg.run.seed,
                                     epochs=cfg.optim.epochs, exclude=eval_indices,
                                     step_batches=len(ddev) * nodes * cfg.optim.grad_accum,
                                     anchors=cfg.drafter.num_anchors)
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
                    eval_sets)


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


def resolve_target(cfg: Config, run_dir: Path, demo_progress,
                   say: Callable[[str], None] | None = None) -> tuple[Path, dict, list[int], int]:
    """(target folder, its config.json, layer ids, mask id), checked against the config; the
    demo's target is built (or taken from the cache) and installed in the run folder. An
    attention implementation the target's class cannot run is replaced in ``cfg`` where one
    works (``say`` gets the line saying so) or refused."""
    target_path = _resolve_target(cfg, run_dir, demo_progress)
    hf_config = _read_target_config(target_path)
    check_target_code(cfg, hf_config, target_path)
    layer_ids, mask_id = _check_target(cfg, hf_config)
    choose_attention(cfg, hf_config, say or (lambda message: None))
    return target_path, hf_config, layer_ids, mask_id


def check_target_code(cfg: Config, hf_config: dict, target_path: Path) -> None:
    """A target that needs the Python files of its own folder (config.json ``auto_map``, a model
    type transformers does not know) is refused unless target.trust_remote_code allows them:
    transformers would otherwise ask on the terminal, or fail at load."""
    if needs_remote_code(hf_config) and not cfg.target.trust_remote_code:
        raise ConfigError("target.trust_remote_code", remote_code_refusal(hf_config, target_path),
                          hint=REMOTE_CODE_HINT)


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


def quantized_weights(cfg: Config, hf_config: dict,
                      tdev: list[torch.device]) -> tuple[bool | None, str | None]:
    """(whether a quantized checkpoint's weights stay as stored on the target devices, the one
    line saying what they take); (None, None) for weights in a plain dtype. transformers runs
    FP8 block-wise weights on a CUDA GPU of compute capability 8.9+ and MXFP4 (gpt-oss) experts
    with triton >= 3.4 and the kernels package; elsewhere it dequantizes them as it loads, to the
    dtype the target runs in. Both need accelerate: without it the load would fail, so refused."""

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
    why = _quantized_cannot_run(method, tdev)
    if why is None:
        return True, (f"target: {label} weights (quant_method {method}) stay as stored: "
                      f"{size_text(stored)} ({size_text(plain)} in {dtype})")
    return False, (f"target: the checkpoint's {label} weights cannot run here ({why}): "
                   f"transformers dequantizes them to {dtype} as it loads, {size_text(plain)} "
                   f"instead of {size_text(stored)}; the memory plan counts {dtype}")


def _quantized_cannot_run(method: str, tdev: list[torch.device]) -> str | None:
    """Why transformers would dequantize ``method`` weights on these devices (None: it runs
    them as stored), by the checks of its quantizers."""
    gpus = [d for d in tdev if d.type == "cuda"]
    if not gpus:
        return "the target runs on the CPU"
    need = (8, 9) if method == "fp8" else (7, 5)
    for d in gpus:
        cap = torch.cuda.get_device_capability(d)
        if tuple(cap) < need:
            return (f"cuda:{d.index} has compute capability {cap[0]}.{cap[1]}, "
                    f"{method} needs {need[0]}.{need[1]}+")
    if method == "mxfp4":
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


def _read_target_config(target_path: Path) -> dict:
    """The target's config.json; a malformed one is target.path's fault, named as such."""
    path = target_path / "config.json"
    try:
        hf_config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise ConfigError("target.path", f"{path} cannot be read as JSON: {exc}",
                          hint="restore the model folder's config.json (e.g. download the model "
                               "again), or set target.path to an intact model folder") from exc
    if not isinstance(hf_config, dict):
        raise ConfigError("target.path", f"{path} holds a {type(hf_config).__name__}, not a "
                          "model config (a JSON object)", hint="set target.path to a model folder")
    return hf_config


def _check_target(cfg: Config, hf_config: dict) -> tuple[list[int], int]:
    try:
        shape = model_shape(hf_config)
    except (ValueError, TypeError) as exc:
        raise ConfigError("target.path", f"the target's config.json: {exc}",
                          hint="set target.path to a causal LM folder with a complete "
                               "config.json (hidden_size, num_hidden_layers, heads, vocab_size)"
                          ) from exc
    n_layers, vocab = shape.layers, shape.vocab
    _check_drafter_heads(cfg, hf_config)
    check_dspark(cfg, vocab)
    layer_ids = cfg.target.layer_ids or default_layer_ids(n_layers, cfg.target.num_features)
    if len(set(layer_ids)) != len(layer_ids):
        raise ConfigError("target.layer_ids", f"{layer_ids} repeats a layer: the target has only "
                          f"{n_layers} layers for {len(layer_ids)} features",
                          hint="set target.num_features lower or list distinct target.layer_ids")
    bad = [i for i in layer_ids if i >= n_layers]
    if bad:
        raise ConfigError("target.layer_ids", f"{bad} out of range: the target has {n_layers} "
                          f"layers (0..{n_layers - 1})", hint="fix target.layer_ids or leave it empty")
    mask_id = cfg.drafter.mask_token_id if cfg.drafter.mask_token_id >= 0 else vocab - 1
    if mask_id >= vocab:
        raise ConfigError("drafter.mask_token_id", f"{mask_id} >= vocab size {vocab}",
                          hint="use an id inside the target vocabulary")
    return layer_ids, mask_id


def check_dspark(cfg: Config, vocab: int) -> None:
    """drafter.objective dspark: its settings against the target's vocabulary (Markov rank,
    block size, gamma, loss weights), and D-PACE refused (its weights presuppose DFlash's
    unlabelled slot 0 and plain CE). One ConfigError naming the key."""
    settings = drafter_kinds.dspark_settings(cfg)
    if settings is None:
        return
    if cfg.drafter.loss == "dpace":
        raise ConfigError("drafter.loss", "dpace does not combine with drafter.objective dspark: "
                          "D-PACE's slot weights presuppose DFlash's unlabelled slot 0 and plain "
                          "cross-entropy; DSpark weighs slots exp(-j/gamma)",
                          hint="set drafter.loss: dflash, or drafter.objective: dflash")
    bad = settings.problems(vocab)
    if bad:
        word, _, rest = bad[0].partition(" ")
        key, said = (word, rest) if word.startswith("drafter.") else ("drafter.ce_weight", bad[0])
        raise ConfigError(key, said, hint=f"change {key} in config.yaml (docs/algorithm.md, "
                          "DSpark)")


def _check_drafter_heads(cfg: Config, hf_config: dict) -> None:
    """Head counts the drafter cannot be built with (its attention groups query heads by key /
    value head), refused with the keys that set them."""
    text = hf_config.get("text_config") or hf_config
    d = cfg.drafter
    heads = d.num_attention_heads or text.get("num_attention_heads") or 0
    kv = d.num_key_value_heads or text.get("num_key_value_heads") or heads
    if heads and kv and heads % kv:
        raise ConfigError(
            "drafter.num_key_value_heads" if d.num_key_value_heads else
            "drafter.num_attention_heads",
            f"the drafter would have {heads} attention heads and {kv} key/value heads: the "
            "heads must be a multiple of the key/value heads",
            hint="set drafter.num_attention_heads and drafter.num_key_value_heads so that the "
                 "first is a multiple of the second (0 = the target's)")
    if d.init_from and not all((Path(d.init_from).expanduser() / f).is_file()
                               for f in ("config.json", "model.safetensors")):
        raise ConfigError("drafter.init_from", f"{d.init_from} is not a drafter checkpoint "
                          "folder (config.json and model.safetensors)",
                          hint="point drafter.init_from at a checkpoint folder, e.g. "
                               "runs/NAME/checkpoints/step-N, or leave it empty")
    if d.init_from and (Path(d.init_from).expanduser() / "checksums.json").is_file():
        # A run's checkpoint records its checksums: a damaged one must not start a run.
        found = verify(Path(d.init_from).expanduser())
        bad = [p for p in found.problems if p.split(" ", 1)[0] in ("config.json",
                                                                   "model.safetensors")]
        if bad:
            raise ConfigError("drafter.init_from", f"{d.init_from} is damaged: {'; '.join(bad)}",
                              hint="point drafter.init_from at an intact checkpoint (another "
                                   "step, or a backup)")


def _resolve_target(cfg: Config, run_dir: Path, demo_progress) -> Path:
    if cfg.target.path == "builtin:tiny":
        demo.ensure_tiny_target(progress=demo_progress("demo target"))
        return demo.install_target(run_dir)
    path = Path(cfg.target.path).expanduser()
    if not (path / "config.json").is_file():
        raise ConfigError("target.path", f"{path} is not a model folder (no config.json)",
                          hint="set target.path to a local folder with config.json and "
                          "*.safetensors")
    return path


def resolve_data(cfg: Config, target_path: Path, demo_progress) -> Path:
    """The data folder; the demo's data is generated by its target (or taken from the cache)."""
    if cfg.data.path == "builtin:demo":
        return demo.ensure_demo_data(target_path, progress=demo_progress("demo data"))
    return Path(cfg.data.path).expanduser()


def check_data_manifest(cfg: Config, data_path: Path, target_path: Path) -> None:
    """Refuse a data folder whose prepare did not finish, or that was tokenized with another
    tokenizer or chat template than the target's (both fingerprints named). Data made otherwise
    (no manifest) is not checked."""
    manifest = read_manifest(data_path) if data_path.is_dir() else None
    fps = _target_fingerprints(cfg, target_path, manifest) if manifest else None
    check_data_folder(data_path, fps, f"the target {cfg.target.path}")


def _target_fingerprints(cfg: Config, target_path: Path, manifest: dict) -> dict | None:
    if cfg.target.path == "builtin:tiny":
        tok = byte_tokenizer()
    elif any((target_path / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
        try:
            tok = AutoTokenizer.from_pretrained(str(target_path), local_files_only=True,
                                                trust_remote_code=cfg.target.trust_remote_code)
        except (OSError, ValueError, TypeError):
            return None  # the target's own check reports an unusable folder
    else:
        return None  # no tokenizer beside the weights: nothing to compare with
    fps = {"tokenizer": tokenizer_fingerprint(tok)}
    if not manifest.get("tokenizer", {}).get("chat_template_file") and tok.chat_template:
        # A template given to prepare by file was chosen on purpose (the serving one): only
        # the folder's own template is compared.
        fps["chat_template"] = template_fingerprint(tok)
    return fps


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
    if not plan.fits:
        hint = "; ".join(format_overflow(o) for o in plan.overflows)
        if sizes:
            hint += ("; these sizes fit: " + ", ".join(f"{k}: {v}" for k, v in sizes.items())
                     + " (or set layout.auto_fit: true to pick them)")
        raise ConfigError(plan.key or "data.token_budget",
                          "the memory plan does not fit:\n" + format_plan(plan), hint=hint)
    return sizes if cfg.layout.auto_fit else {}


def demo_log_progress(publish: Callable[[Event], None], stop_check: Callable[[], None]):
    """Progress callbacks for building the demo assets: a Log line every 10%."""
    def for_what(what: str) -> Progress:
        last = [-1.0]

        def report(fraction: float, message: str = "") -> None:
            stop_check()
            if fraction - last[0] >= 0.1 or fraction >= 1.0:
                last[0] = fraction
                publish(Log(level="info", source="demo",
                            message=f"{what}: {fraction:.0%} {message}".rstrip()))
        return report
    return for_what


MASK_PROBE_SAMPLES = 2000  # spread over the data set: milliseconds, whatever its size


def check_something_trains(dataset: Any, data_path: Path) -> None:
    """A loss mask of zeros everywhere trains nothing: every step's loss weight would be 0 and
    the run would "finish" having learnt nothing. Probes samples spread over the data set (all
    of them when there are fewer than MASK_PROBE_SAMPLES) for one trained position past the
    first token (the first is never predicted)."""

    n = len(dataset)
    picks = np.unique(np.linspace(0, n - 1, min(n, MASK_PROBE_SAMPLES)).astype(np.int64))
    for i in picks:
        _, mask = dataset.get(int(i))
        if np.any(np.asarray(mask)[1:]):
            return
    scope = "every sample" if len(picks) == n else f"all {len(picks)} samples probed (of {n})"
    raise ConfigError("data.path", f"the loss mask is 0 in {scope} of {data_path}: no token "
                      f"would be trained",
                      hint="loss_mask marks the tokens to learn (1 = the assistant's answer); "
                           "re-make the data (dflash-tui data prepare) or drop the loss_mask "
                           "column to train on every token")
