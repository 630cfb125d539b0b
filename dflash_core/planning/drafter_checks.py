"""Preflight's checks of the drafter's settings against the target, before any weight loads.

Head counts the drafter cannot be built with, a drafter.init_from that is not an intact
checkpoint or not one the run's family can load, the drafter family's settings against the
target's vocabulary, and a fused loss the drafter devices cannot run. Apart from
target_checks.py, which reads the target folder and calls these with its config.json: they judge
drafter.* keys, each refusal a ConfigError naming the key.
"""

from __future__ import annotations

import json
from pathlib import Path

from dflash_core.config import Config, ConfigError
from dflash_core.families.registry import family_of
from dflash_core.checkpoint.checksums import verify
from dflash_core.models.rope_settings import RopeConflict, config_rope
from dflash_core.models.fused_loss import select as fused_loss


def check_family(cfg: Config, vocab: int) -> None:
    """drafter.objective's own settings against the target's vocabulary (DSpark's Markov rank,
    block size, gamma, loss weights), then what never combines with the family (DSpark: D-PACE).
    One ConfigError naming the key."""
    family = family_of(cfg)
    for p in family.problems(cfg.drafter, vocab) + family.refusals(cfg.drafter):
        raise ConfigError(p.key, p.message, hint=p.hint)


def check_fused_loss(cfg: Config, drafter_devices) -> None:
    """drafter.fused_loss: on where the drafters cannot run it (not on CUDA, or no Triton),
    refused in one line naming the key (select.py)."""
    for dev in drafter_devices:
        refused = fused_loss.refusal(cfg.drafter.fused_loss, dev.type)
        if refused is not None:
            raise refused


def fused_loss_line(cfg: Config) -> str:
    """The loss a CUDA drafter runs, in one line for the log: fused or torch, and why."""
    mode = cfg.drafter.fused_loss
    if not family_of(cfg).has_fused_loss:
        return (f"drafter loss: torch (chunked, logits recomputed in backward; drafter.objective "
                f"{cfg.drafter.objective} has no fused loss)")
    if fused_loss.fused(mode, "cuda"):
        return (f"drafter loss: fused (Triton kernels beside the lm_head's matmuls; "
                f"drafter.fused_loss {mode})")
    why = "off" if mode == "off" else "auto, Triton is not installed"
    return f"drafter loss: torch (chunked, logits recomputed in backward; drafter.fused_loss {why})"


def check_drafter_heads(cfg: Config, hf_config: dict) -> None:
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
    if d.init_from:
        _check_init_rope(Path(d.init_from).expanduser() / "config.json")
        _check_init_family(cfg)


def _check_init_family(cfg: Config) -> None:
    """drafter.init_from judged as the loader will judge it after the target loads: its family
    against drafter.objective (or one that family starts from), the family's own checks of its
    config.json and tensor names, model.safetensors' header whole. One ConfigError naming the
    key."""
    from dflash_core.models.registry import check_folder, init_from_refusal

    folder = Path(cfg.drafter.init_from).expanduser()
    try:
        check_folder(folder, cfg.drafter.objective, family_of(cfg).settings(cfg.drafter))
    except (ValueError, TypeError, KeyError, OSError) as exc:
        raise init_from_refusal(cfg.drafter.init_from, cfg.drafter.objective, exc) from exc


def _check_init_rope(path: Path) -> None:
    """drafter.init_from's rotary settings, read as serving stacks read them: its two spellings
    (rope_parameters, rope_theta + rope_scaling) must agree."""
    try:
        config_rope(json.loads(path.read_text(encoding="utf-8")))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return  # an unreadable config.json: the resume check names it (resume.py)
    except (RopeConflict, ValueError) as exc:
        raise ConfigError("drafter.init_from", f"{path}: rotary settings: {exc}",
                          hint="make rope_parameters and rope_theta / rope_scaling in that "
                               "config.json say the same") from exc
