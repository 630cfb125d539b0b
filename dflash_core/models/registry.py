"""The drafter class of each family (families/registry.py holds the families themselves):
a new drafter, or one rebuilt from a checkpoint's config.json or a model folder, refusing a
drafter of another family than the run's."""

from __future__ import annotations

import json
from pathlib import Path

from dflash_core.families.registry import FAMILIES, OBJECTIVES, family, objective_of
from dflash_core.models.dflash.drafter import DFlashDrafter
from dflash_core.models.dspark.drafter import DSparkDrafter
from dflash_core.models.dflash2.drafter import DFlash2Drafter

# One registration per family: its drafter class answers for it (DFlashDrafter's interface).
DRAFTERS: dict[str, type[DFlashDrafter]] = {c.family.name: c for c in (DFlashDrafter, DSparkDrafter,
                                                                   DFlash2Drafter)}
assert tuple(DRAFTERS) == OBJECTIVES, "every family registers one drafter class"

__all__ = ["DRAFTERS", "OBJECTIVES", "ObjectiveMismatch", "check_folder", "drafter_class",
           "drafter_from_config", "expected_config", "init_from_refusal", "load_drafter",
           "new_drafter", "new_config", "objective_of"]


class ObjectiveMismatch(ValueError):
    """A checkpoint or model folder of the other objective than the run's."""

    error_kind = "config"

    def __init__(self, where: str, found: str, wanted: str):
        super().__init__(f"{where} holds {FAMILIES[found].title}, but drafter.objective is "
                         f"{wanted}: set drafter.objective: {found} to continue it, or start a "
                         "new run (another run name or output folder)")
        self.found, self.wanted = found, wanted


def drafter_class(objective: str) -> type[DFlashDrafter]:
    return DRAFTERS[family(objective).name]


def new_config(objective: str, target_config, *, num_layers: int, target_layer_ids: list[int],
               block_size: int, mask_token_id: int, settings=None, **widths):
    """The config of a fresh drafter of ``objective`` shaped like the target. ``settings``: the
    family's (DSpark takes its block size from them); ``block_size`` is DFlash's. ``widths``:
    hidden_size, intermediate_size, num_attention_heads, num_key_value_heads."""
    return drafter_class(objective).new_config(
        target_config, num_layers=num_layers, target_layer_ids=target_layer_ids,
        block_size=block_size, mask_token_id=mask_token_id, settings=settings, **widths)


def new_drafter(objective: str, target_config, *, num_layers: int, target_layer_ids: list[int],
                block_size: int, mask_token_id: int, settings=None, **widths) -> DFlashDrafter:
    """A freshly initialised drafter shaped like the target (seed torch first); ``settings``:
    the family's (None: its defaults)."""
    cfg = new_config(objective, target_config, num_layers=num_layers,
                     target_layer_ids=target_layer_ids, block_size=block_size,
                     mask_token_id=mask_token_id, settings=settings, **widths)
    return drafter_class(objective)(cfg)


def expected_config(objective: str, target_config, **kw) -> dict:
    """The config.json a fresh drafter of ``objective`` writes (new_config's keywords)."""
    return drafter_class(objective).serve_config_of(new_config(objective, target_config, **kw))


def _check_found(config: dict, objective: str, where: str) -> type[DFlashDrafter]:
    cls = drafter_class(objective)
    found = objective_of(config)
    if found != objective:
        raise ObjectiveMismatch(where, found, objective)
    return cls


def drafter_from_config(config: dict, objective: str, where: str = "the checkpoint"):
    """An uninitialised drafter of a checkpoint's config.json (load its weights next); raises
    ObjectiveMismatch when the config is the other kind's."""
    cls = _check_found(config, objective, where)
    return cls(cls.config_from_dict(config))


def _starts_from(config: dict, objective: str) -> bool:
    """Whether ``objective``'s drafter starts from a folder of ``config``'s other family
    (its class's ``starts_from``: DFlash2 from DFlash)."""
    try:
        found = objective_of(config)
    except ValueError:
        return False
    return found != objective and found in getattr(drafter_class(objective), "starts_from", ())


def load_drafter(folder: str | Path, objective: str, settings=None):
    """A drafter from a model folder (``drafter.init_from``) of the run's objective, or of a
    family it starts from (``settings``: the run family's, for that case)."""
    folder = Path(folder)
    config = json.loads((folder / "config.json").read_text())
    if _starts_from(config, objective):
        return drafter_class(objective).start_from(folder, settings)
    cls = _check_found(config, objective, str(folder))
    return cls.load(folder)


def check_folder(folder: str | Path, objective: str, settings=None) -> None:
    """What load_drafter refuses of ``folder``, found from its config.json and model.safetensors'
    header alone (no weight read; preflight): ObjectiveMismatch, a family's own refusal of its
    config or tensor names, or a file that cannot be read (each a ValueError or OSError)."""
    from dflash_core.checkpoint.checksums import check_safetensors

    folder = Path(folder)
    config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    if _starts_from(config, objective):
        drafter_class(objective).start_config(config, settings)
        cls = drafter_class(objective_of(config))  # the folder's tensors are its own family's
    else:
        cls = _check_found(config, objective, str(folder))
        cls.config_from_dict(config)
    try:  # a truncated file is named here, not when the weights are read after the target
        names = check_safetensors(folder / "model.safetensors")
    except (KeyError, TypeError, AttributeError, ValueError) as exc:
        raise ValueError(f"model.safetensors cannot be read ({exc})") from exc
    cls.check_names(names)
    cls.check_folder_files(folder)


def init_from_refusal(folder, objective: str, exc: Exception):
    """The ConfigError naming drafter.init_from for a folder check_folder or load_drafter
    refused, with a fix suited to starting from a folder (not resuming one)."""
    from dflash_core.config import ConfigError

    if isinstance(exc, ObjectiveMismatch):
        starts = getattr(drafter_class(objective), "starts_from", ())
        other = "".join(f" or of {FAMILIES[f].title} (the family {objective} starts from)"
                        for f in starts)
        return ConfigError("drafter.init_from", f"{folder} holds {FAMILIES[exc.found].title}, "
                           f"but drafter.objective is {objective}",
                           hint=f"point drafter.init_from at the folder of "
                                f"{FAMILIES[objective].title}{other}, or set drafter.objective: "
                                f"{exc.found} to train from this one")
    why = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
    return ConfigError("drafter.init_from", f"{folder}: {why}",
                       hint="point drafter.init_from at a drafter folder this engine can load "
                            "(e.g. runs/NAME/checkpoints/step-N), or leave it empty")


def start_config(config: dict, objective: str, settings=None) -> dict:
    """The config.json a run of ``objective`` started from a folder of ``config`` writes
    (the folder's own when it is of that objective)."""
    if not _starts_from(config, objective):
        return config
    cls = drafter_class(objective)
    return cls.serve_config_of(cls.start_config(config, settings))
