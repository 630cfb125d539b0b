"""Preflight's checks of the target folder, from its config.json alone (no weight loaded).

The folder (the demo's target built and installed in the run folder), its config.json, the code it
needs (target.trust_remote_code), its layer ids and mask id, then the attention implementation
its class can run (attention_choice.py); the drafter settings that depend on the target are
drafter_checks.py's. Apart from preflight.py, which runs these in order with the data and memory
checks: each refusal is a ConfigError naming the key and the fix.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

from dflash_core import demo
from dflash_core.config import Config, ConfigError
from dflash_core.models.target.config_fields import HINT, ConfigFieldError, check_config_fields
from dflash_core.models.target.shape import model_shape
from dflash_core.models.target.config import (
    REMOTE_CODE_HINT, TargetLoadError, check_code_files, default_layer_ids, needs_remote_code,
    remote_code_refusal,
)
from dflash_core.planning.attention_choice import choose_attention
from dflash_core.planning.drafter_checks import check_drafter_heads, check_family


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
    last = last_layer_warning(layer_ids, model_shape(hf_config).layers)
    if last and say is not None:
        say(last)
    choose_attention(cfg, hf_config, say or (lambda message: None))
    return target_path, hf_config, layer_ids, mask_id


def last_layer_warning(layer_ids: list[int], n_layers: int) -> str:
    """The line for features that include the target's last layer ("" when they do not):
    transformers hands that layer's output over after the final norm, while vLLM and SGLang
    capture it before the norm, so a drafter trained on it is served other features."""
    if n_layers - 1 not in layer_ids:
        return ""
    if n_layers >= 4:
        instead = (f"use layers below {n_layers - 1} (the default spreads them from 1 to "
                   f"{n_layers - 3})")
    elif n_layers > 1:
        instead = f"use layers below {n_layers - 1}"
    else:
        instead = "a target of one layer has no other"
    return (f"target.layer_ids {layer_ids} includes layer {n_layers - 1}, the target's last: "
            "training reads its output after the final norm, but vLLM and SGLang capture it "
            "before the norm, so the served drafter gets other features than it trained on; "
            + instead)


def check_target_code(cfg: Config, hf_config: dict, target_path: Path) -> None:
    """A target that needs the Python files of its own folder (config.json ``auto_map``, a model
    type transformers does not know) is refused unless target.trust_remote_code allows them:
    transformers would otherwise ask on the terminal, or fail at load."""
    if needs_remote_code(hf_config) and not cfg.target.trust_remote_code:
        raise ConfigError("target.trust_remote_code", remote_code_refusal(hf_config, target_path),
                          hint=REMOTE_CODE_HINT)
    if cfg.target.trust_remote_code:
        try:  # its code missing from the folder: said here, before a worker starts to load it
            check_code_files(hf_config, target_path)
        except TargetLoadError as exc:
            raise ConfigError("target.path", str(exc), hint=exc.hint) from exc


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
    try:
        check_config_fields(hf_config, path)
    except ConfigFieldError as exc:
        raise ConfigError("target.path", str(exc), hint=HINT) from exc
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
    check_drafter_heads(cfg, hf_config)
    check_family(cfg, vocab)
    layer_ids = cfg.target.layer_ids or _default_layers(n_layers, cfg.target.num_features)
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


def _default_layers(n_layers: int, k: int) -> list[int]:
    """target.layer_ids left empty: the default, or the refusal of a target too shallow for it."""
    try:
        return default_layer_ids(n_layers, k)
    except ValueError as exc:
        if n_layers < 2:
            hint = "set target.layer_ids: [0], its only layer (accepted with a warning)"
        else:
            hint = f"list target.layer_ids below its last layer (0..{n_layers - 2})" + (
                ", or set target.num_features: 1 (the middle layer)" if k > 1 else "")
        raise ConfigError("target.layer_ids", f"empty, and {exc} (target.num_features {k})",
                          hint=hint) from exc


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
