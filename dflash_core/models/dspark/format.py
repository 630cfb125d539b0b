"""The DSpark checkpoint as vLLM and SGLang load it (docs/checkpoint-format.md, DSpark).

A folder with ``config.json`` and ``model.safetensors``:

- config.json: the drafter's Qwen3 config (shaped like the target's) with DSpark's entries at the
  TOP level, no ``dflash_config`` block: ``architectures: ["Qwen3DSparkModel"]``,
  ``num_target_layers``, ``num_hidden_layers``, ``block_size``, ``mask_token_id``,
  ``target_layer_ids``, ``num_anchors``, ``tie_word_embeddings: false``, ``layer_types``,
  ``markov_rank``, ``markov_head_type: "vanilla"``, ``enable_confidence_head``,
  ``confidence_head_with_markov``; the slot layout, anchor-first, stated both ways servers read
  it: ``sample_from_anchor: true`` (vLLM's and SGLang's key; a 1+N, speculators-style folder
  says false) and ``dspark_bonus_anchor: false`` (the older key); the other serving keys of
  models/served_keys.py (``is_causal: false``, ...); the target's rotary settings as
  ``rope_parameters`` and as ``rope_theta`` + ``rope_scaling`` (models/rope_settings.py).
- model.safetensors: DFlash's keys (``layers.*``, ``norm``, ``fc``, ``hidden_norm``), the heads
  (``markov_head.markov_w1.weight`` [V, r], ``markov_head.markov_w2.weight`` [V, r],
  ``confidence_head.proj.weight`` [1, H+r], ``confidence_head.proj.bias`` [1]) and copies of the
  target's ``embed_tokens.weight`` and ``lm_head.weight`` [V, H] (frozen, never trained), in the
  served dtype (bf16).

The trained state (what resume restores and the optimizer steps) is the drafter's own
``state_dict()``; the two frozen copies are added for the served file only (``frozen_tensors``).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import Qwen3Config

from dflash_core.families.dspark import ARCHITECTURE
from dflash_core.models import served_keys as serving
from dflash_core.models.rope_settings import config_kwargs, config_rope, served_keys

# The served format's names (what vLLM and SGLang look for; ARCHITECTURE is the family's).
ARCHITECTURE_FAMILY = "dspark"  # served_keys' name of this family
MARKOV_HEAD_TYPE = "vanilla"  # the only type this engine trains (the reference's default)

FROZEN_KEYS = ("embed_tokens.weight", "lm_head.weight")
_DROPPED = ("model_type", "transformers_version")


class NotDSpark(ValueError):
    """A config.json that is not a DSpark drafter this engine can load."""


def serve_config(drafter) -> dict:
    """config.json of ``drafter`` (a DSparkDrafter)."""
    return serve_config_of(drafter.config)


def serve_config_of(cfg: Qwen3Config) -> dict:
    """config.json of a DSpark drafter config (dspark.build_dspark_config's): what a run of it
    writes, known before any weight exists (a resume compares a checkpoint's with it)."""
    d = cfg.to_dict()
    dc = d.pop("dflash_config")
    L = int(cfg.num_hidden_layers)
    d.update({
        "architectures": [ARCHITECTURE],
        "num_target_layers": int(cfg.num_target_layers),
        "num_hidden_layers": L,
        "block_size": int(dc["block_size"]),
        "mask_token_id": int(dc["mask_token_id"]),
        "target_layer_ids": [int(i) for i in dc["target_layer_ids"]],
        "num_anchors": int(getattr(cfg, "num_anchors", 512)),
        "tie_word_embeddings": False,
        "layer_types": ["full_attention"] * L,
        "markov_rank": int(cfg.markov_rank),
        "markov_head_type": MARKOV_HEAD_TYPE,
        "enable_confidence_head": bool(cfg.enable_confidence_head),
        "confidence_head_with_markov": True,
    })
    # the slot layout (anchor-first) and the other keys a server reads, stated
    d.update(serving.stated(ARCHITECTURE_FAMILY, bool(dc.get("causal", False)))[0])
    d.update(served_keys(config_rope(cfg)))  # both spellings servers read (rope_settings.py)
    return d


def config_from_serve_dict(d: dict) -> Qwen3Config:
    """The drafter's config from a served config.json (this engine's or the reference's), read
    as vLLM reads it (served_keys.read: the slot layout, the block's causality, the feature
    layers). Raises NotDSpark, naming the key, for anything else."""
    arch = d.get("architectures")
    if arch != [ARCHITECTURE]:
        raise NotDSpark(f"config.json has architectures {arch}, not [{ARCHITECTURE!r}]: not a "
                        "DSpark drafter")
    missing = [k for k in ("block_size", "mask_token_id", "target_layer_ids", "markov_rank")
               if k not in d]
    if missing:
        raise NotDSpark(f"DSpark config.json lacks {', '.join(missing)}: not a complete "
                        "DSpark drafter folder")
    kind = d.get("markov_head_type", MARKOV_HEAD_TYPE)
    if kind != MARKOV_HEAD_TYPE:
        raise NotDSpark(f"markov_head_type {kind!r}: this engine has only the "
                        f"{MARKOV_HEAD_TYPE!r} Markov head")
    if d.get("enable_confidence_head") and not d.get("confidence_head_with_markov", True):
        raise NotDSpark("confidence_head_with_markov false: this engine's confidence head reads "
                        "[h ; W1[prev]] (true)")
    try:
        judged, keys = serving.read(d, ARCHITECTURE_FAMILY)
    except serving.ServedKeyRefused as exc:
        raise NotDSpark(str(exc)) from exc
    rest = {k: v for k, v in config_kwargs(judged).items()
            if k not in _DROPPED and k != "dflash_config"}
    cfg = Qwen3Config(**rest)
    cfg.architectures = [ARCHITECTURE]
    cfg.dflash_config = {"target_layer_ids": keys.target_layer_ids,
                         "block_size": int(d["block_size"]),
                         "mask_token_id": int(d["mask_token_id"]), "causal": keys.causal}
    cfg.num_target_layers = int(d.get("num_target_layers", 0))
    cfg.markov_rank = int(d["markov_rank"])
    cfg.markov_head_type = MARKOV_HEAD_TYPE
    cfg.enable_confidence_head = bool(d.get("enable_confidence_head", False))
    cfg.confidence_head_with_markov = True
    cfg.num_anchors = int(d.get("num_anchors", 512))
    return cfg


def frozen_tensors(drafter) -> dict[str, torch.Tensor]:
    """The target's embedding and lm_head as the served file names them (not trained: no master
    copy, no optimizer state; written into model.safetensors only)."""
    return {"embed_tokens.weight": drafter.embed_tokens.weight.detach(),
            "lm_head.weight": drafter.lm_head.weight.detach()}


def frozen_numel(config) -> int:
    """Elements the frozen copies add to model.safetensors (for the checkpoint size estimate)."""
    return 2 * int(config.vocab_size) * int(config.hidden_size)


def serve_state(drafter) -> dict[str, torch.Tensor]:
    """Every tensor of the served model.safetensors, detached, contiguous, on the CPU, in the
    weights' own dtypes (the writer casts floats to the served dtype)."""
    state = dict(drafter.state_dict()) | frozen_tensors(drafter)
    return {k: v.detach().contiguous().cpu() for k, v in state.items()}


def save_folder(drafter, folder: str | os.PathLike, dtype: torch.dtype | None = torch.bfloat16
                ) -> None:
    """Write config.json and model.safetensors (floats in ``dtype``; None keeps them). Each file
    is written beside its final name and renamed into place, the weights first, so a folder with
    a config.json never holds a half-written model."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    state = serve_state(drafter)
    if dtype is not None:
        state = {k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items()}
    for name, write in (
            ("model.safetensors", lambda p: save_file(state, str(p), metadata={"format": "pt"})),
            ("config.json", lambda p: p.write_text(json.dumps(serve_config(drafter), indent=2)))):
        tmp = folder / f".{name}.tmp-{os.getpid()}"
        try:
            write(tmp)
            os.replace(tmp, folder / name)
        finally:
            tmp.unlink(missing_ok=True)


def load_head(folder: str | os.PathLike, device="cpu") -> dict[str, torch.Tensor]:
    """The frozen embedding and lm_head copies of a served folder."""
    state = load_file(str(Path(folder) / "model.safetensors"), device=str(device))
    return {k: state[k] for k in FROZEN_KEYS if k in state}
