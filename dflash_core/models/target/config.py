"""What a target folder's config.json says, and whether the engine may build it from there.

The checks made before any weight is read: the model type must have a causal-LM class in
transformers, and code shipped in the folder (config.json ``auto_map``) runs only with
``trust_remote_code``, passed explicitly so transformers never asks on the terminal. Also the
default choice of feature layers and the error a bad target raises. Apart from loading
(target/load.py) and the model (target/model.py): preflight, a resume and the evaluation runner ask
these questions without loading anything.
"""

from __future__ import annotations

import json
from pathlib import Path

from dflash_core.models.target.config_fields import HINT, ConfigFieldError, check_config_fields

CONFIG_NAME = "config.json"

PATH_HINT = ("set target.path in config.yaml to a local folder holding config.json and "
             "model.safetensors (or model.safetensors.index.json and its shards)")


class TargetLoadError(RuntimeError):
    """The target cannot be loaded as configured. ``hint`` says what to change in config.yaml."""

    def __init__(self, message: str, hint: str = PATH_HINT, error_kind: str = "config"):
        super().__init__(message)
        self.hint = hint
        self.error_kind = error_kind


def default_layer_ids(num_layers: int, k: int = 5) -> list[int]:
    """k layer ids spread evenly from 1 to num_layers-3 (0-based), as the reference dflash does;
    one alone is the middle layer. Never the last layer: transformers hands its output over after
    the final norm, vLLM and SGLang capture it before, so a drafter trained on it is served other
    features (a config that names it is accepted with preflight's warning)."""
    if k < 1 or num_layers < 1:
        raise ValueError(f"need k >= 1 and num_layers >= 1, got k={k}, num_layers={num_layers}")
    if k == 1:
        if num_layers < 2:
            raise ValueError("a target of 1 layer has no layer below its last to default to")
        return [min(num_layers // 2, num_layers - 2)]  # of 2 layers, the first
    if num_layers < 4:
        raise ValueError(f"a target with {num_layers} layers is too shallow for the default spread "
                         "from layer 1 to N-3")
    span = num_layers - 4
    return [int(round(1 + i * span / (k - 1))) for i in range(k)]


REMOTE_CODE_HINT = ("set target.trust_remote_code: true in config.yaml if you trust the *.py "
                    "files in that folder (they run in this process), or point target.path at a "
                    "model transformers supports (docs/targets.md)")


def causal_lm_class(hf_config: dict):
    """The class transformers' AutoModelForCausalLM builds for a config.json of a model type it
    knows (a multimodal wrapper for some: Gemma 3), else None (unknown, or only remote code)."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(str(hf_config.get("model_type")))
    return getattr(transformers, name, None) if name else None


def needs_remote_code(hf_config: dict) -> bool:
    """The folder's config.json maps the model to Python files of its own (``auto_map``) for a
    model transformers cannot build itself. A known model type with an auto_map (DeepSeek-V3's
    config.json has one) is built from transformers' own code and needs none."""
    auto_map = hf_config.get("auto_map")
    return bool(auto_map) and causal_lm_class(hf_config) is None


def remote_code_refusal(hf_config: dict, folder: Path,
                        switch: str = "target.trust_remote_code is off") -> str:
    """The one line saying that the target needs its own code, and why (``switch``: what did
    not allow it, the config key or a command's flag)."""
    import transformers

    names = sorted(hf_config.get("auto_map") or {})
    return (f"the target {folder} needs its own code: its config.json maps {', '.join(names)} "
            f"to Python files in the folder (auto_map), and transformers "
            f"{transformers.__version__} cannot build model type "
            f"{hf_config.get('model_type')!r} itself; {switch}")


def _read_config_json(folder: Path) -> dict:
    try:
        data = json.loads((folder / CONFIG_NAME).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise TargetLoadError(f"cannot read the target config {folder / CONFIG_NAME}: {exc}"
                              ) from exc
    if not isinstance(data, dict):
        raise TargetLoadError(f"{folder / CONFIG_NAME} holds no JSON object")
    try:
        check_config_fields(data, folder / CONFIG_NAME)
    except ConfigFieldError as exc:
        raise TargetLoadError(str(exc), hint=HINT) from exc
    return data


def load_target_config(folder: Path, trust_remote_code: bool = False, *,
                       switch: str = "target.trust_remote_code is off",
                       hint: str = REMOTE_CODE_HINT):
    """The target's transformers config, refused in one line when it needs code it may not run
    (never the terminal prompt) or has no causal-LM class. ``switch`` and ``hint``: the
    refusal's words for what did not allow the code and how to allow it (the run's config key
    by default; a command's flag)."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    raw = _read_config_json(folder)
    # Before transformers sees it: with trust_remote_code unset it would ask on the terminal.
    if needs_remote_code(raw) and not trust_remote_code:
        raise TargetLoadError(remote_code_refusal(raw, folder, switch), hint=hint)
    try:
        config = AutoConfig.from_pretrained(folder, local_files_only=True,
                                            trust_remote_code=trust_remote_code)
    except (OSError, ValueError, KeyError, ImportError) as exc:
        raise TargetLoadError(
            f"cannot read the target config {folder / CONFIG_NAME}: {exc}") from exc
    # Checked before reading gigabytes of weights: the model type must have a causal-LM class.
    own = trust_remote_code and "AutoModelForCausalLM" in (raw.get("auto_map") or {})
    if type(config) not in MODEL_FOR_CAUSAL_LM_MAPPING and not own:
        raise TargetLoadError(
            f"target {folder}: model type {config.model_type!r} has no causal-LM class in "
            "transformers",
            hint="point target.path at a causal language model (docs/targets.md lists those "
                 "that are supported)")
    return config
