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
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Union

from dflash_core.models.target.config_fields import HINT, ConfigFieldError, check_config_fields

CONFIG_NAME = "config.json"


@dataclass(frozen=True)
class Words:
    """How a verb's user changes what the target loader reads, in the words its hints use: a run
    and ``check`` name config.yaml's keys, ``eval`` and the data verbs their flags. A hint that
    names the wrong verb's fix sends the user to a file the command never reads."""

    point: str  # + " <a folder>": how to give another target folder
    trust: str  # how to let the folder's own Python files run
    trust_off: str  # what did not let them run
    dtype: str  # + " <a dtype>"
    attention: str  # where the target and its attention implementation are chosen
    dflash: str  # how to use a DFlash drafter instead of a DSpark one


CONFIG_WORDS = Words(
    point="set target.path in config.yaml to",
    trust="set target.trust_remote_code: true in config.yaml",
    trust_off="target.trust_remote_code is off",
    dtype="set target.dtype in config.yaml to",
    attention="check target.path and target.attn_implementation in config.yaml",
    dflash="use drafter.objective: dflash with this target")
# eval, data inspect, data regenerate: --target FOLDER and --trust-remote-code
FLAG_WORDS = Words(
    point="pass --target",
    trust="pass --trust-remote-code",
    trust_off="--trust-remote-code is not given",
    dtype="pass --dtype",
    attention="check the folder given to --target",
    dflash="evaluate a DFlash drafter with this target")

Hint = Union[str, Callable[[Words], str]]


def path_hint(w: Words) -> str:
    return (f"{w.point} a local folder holding config.json and model.safetensors (or "
            "model.safetensors.index.json and its shards)")


PATH_HINT = path_hint(CONFIG_WORDS)


class TargetLoadError(RuntimeError):
    """The target cannot be loaded as given. ``hint`` says what to change in the run's words
    (config.yaml); ``hint_in(words)`` in another verb's (a hint given as a function of Words
    is worded per verb, a plain string is the same for every verb)."""

    def __init__(self, message: str, hint: Hint = path_hint, error_kind: str = "config"):
        super().__init__(message)
        self._hint = hint
        self.error_kind = error_kind

    def hint_in(self, words: Words) -> str:
        return self._hint(words) if callable(self._hint) else self._hint

    @property
    def hint(self) -> str:
        return self.hint_in(CONFIG_WORDS)

    @hint.setter
    def hint(self, value: str) -> None:
        self._hint = value


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


def remote_code_hint(w: Words) -> str:
    return (f"{w.trust} if you trust the *.py files in that folder (they run in this process), "
            f"or {w.point} a model transformers supports (docs/targets.md)")


REMOTE_CODE_HINT = remote_code_hint(CONFIG_WORDS)


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
                        switch: str = CONFIG_WORDS.trust_off) -> str:
    """The one line saying that the target needs its own code, and why (``switch``: what did
    not allow it, the config key or a command's flag)."""
    import transformers

    names = sorted(hf_config.get("auto_map") or {})
    return (f"the target {folder} needs its own code: its config.json maps {', '.join(names)} "
            f"to Python files in the folder (auto_map), and transformers "
            f"{transformers.__version__} cannot build model type "
            f"{hf_config.get('model_type')!r} itself; {switch}")


# The auto_map entries a target is built from (the config, then the model).
_BUILT_FROM = ("AutoConfig", "AutoModelForCausalLM")


def lacking_code(hf_config: dict, folder: Path) -> list[str]:
    """The Python files config.json's auto_map names for the target's config and model that the
    folder does not hold (copied without its *.py files, say). An entry of another repository
    (``repo--module.Class``) is transformers' to fetch, not looked for here."""
    auto_map = hf_config.get("auto_map") or {}
    missing = []
    for key in _BUILT_FROM:
        refs = auto_map.get(key)
        for ref in refs if isinstance(refs, list) else [refs]:
            if not isinstance(ref, str) or "--" in ref or "." not in ref:
                continue
            name = ref.rsplit(".", 1)[0].replace(".", "/") + ".py"
            if not (folder / name).is_file() and name not in missing:
                missing.append(name)
    return missing


def check_code_files(hf_config: dict, folder: Path) -> None:
    """Refuses, in one line naming them, a target whose own code (trusted) is not in its folder:
    transformers would say the folder lacks the file and point at a Hub page built from the
    local path (``https://huggingface.co//models/x/tree/main``)."""
    missing = lacking_code(hf_config, folder)
    if missing:
        names = ", ".join(k for k in _BUILT_FROM if k in (hf_config.get("auto_map") or {}))
        raise TargetLoadError(
            f"the target {folder} lacks the Python files its config.json's auto_map names for "
            f"{names}: {', '.join(missing)} (the model is built from that code, and the "
            "folder was copied without it)",
            hint=lambda w: (f"copy {', '.join(missing)} into {folder} from the model's release "
                            f"(they sit beside its config.json), or {w.point} a complete copy "
                            "of the model"))


# transformers' advice for a file a Hub repository lacks; for a local folder it names a page
# that does not exist (the folder's path after https://huggingface.co/)
_HUB_ADVICE = re.compile(r"\s*Checkout 'https://huggingface\.co/[^']*'[^.]*\.")


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
        raise TargetLoadError(str(exc), hint=lambda w: HINT.replace(
            "set target.path to", w.point)) from exc
    return data


def load_target_config(folder: Path, trust_remote_code: bool = False, *,
                       words: Words = CONFIG_WORDS):
    """The target's transformers config, refused in one line when it needs code it may not run
    (never the terminal prompt), code its folder lacks, or has no causal-LM class. ``words``:
    the verb's words for what did not allow the code (the run's config key by default; a
    command's flag); the hints are worded per verb by the catcher (TargetLoadError.hint_in)."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    raw = _read_config_json(folder)
    # Before transformers sees it: with trust_remote_code unset it would ask on the terminal.
    if needs_remote_code(raw) and not trust_remote_code:
        raise TargetLoadError(remote_code_refusal(raw, folder, words.trust_off),
                              hint=remote_code_hint)
    if trust_remote_code:
        check_code_files(raw, folder)
    try:
        config = AutoConfig.from_pretrained(folder, local_files_only=True,
                                            trust_remote_code=trust_remote_code)
    except (OSError, ValueError, KeyError, ImportError) as exc:
        said = _HUB_ADVICE.sub("", str(exc))
        raise TargetLoadError(f"cannot read the target config {folder / CONFIG_NAME}: {said}"
                              ) from exc
    # Checked before reading gigabytes of weights: the model type must have a causal-LM class.
    own = trust_remote_code and "AutoModelForCausalLM" in (raw.get("auto_map") or {})
    if type(config) not in MODEL_FOR_CAUSAL_LM_MAPPING and not own:
        raise TargetLoadError(
            f"target {folder}: model type {config.model_type!r} has no causal-LM class in "
            "transformers",
            hint=lambda w: f"{w.point} a causal language model (docs/targets.md lists those "
                           "that are supported)")
    return config
