"""The two drafters the engine trains, chosen by objective ("dflash" | "dspark"): a new one, or
one rebuilt from a checkpoint's config.json or a model folder, refusing the other kind."""

from __future__ import annotations

import json
from pathlib import Path

from dflash_core.models import drafter_objective
from dflash_core.models.dspark import drafter as dspark
from dflash_core.models.dflash.drafter import ARCHITECTURE as DFLASH_ARCHITECTURE
from dflash_core.models.dflash.drafter import DFlashDrafter, build_drafter_config
from dflash_core.models.dspark.drafter import DSparkDrafter, DSparkSettings, build_dspark_config

OBJECTIVES = drafter_objective.OBJECTIVES
_CLASSES = {"dflash": DFlashDrafter, "dspark": DSparkDrafter}
_NAMES = {"dflash": "a DFlash drafter", "dspark": "a DSpark drafter"}


class ObjectiveMismatch(ValueError):
    """A checkpoint or model folder of the other objective than the run's."""

    error_kind = "config"

    def __init__(self, where: str, found: str, wanted: str):
        super().__init__(f"{where} holds {_NAMES[found]}, but drafter.objective is {wanted}: "
                         f"set drafter.objective: {found} to continue it, or start a new run "
                         "(another run name or output folder)")
        self.found, self.wanted = found, wanted


def _check(objective: str) -> None:
    if objective not in OBJECTIVES:
        raise ValueError(f"drafter.objective {objective!r}: use one of {', '.join(OBJECTIVES)}")


def objective_of(config: dict) -> str:
    """The objective a drafter config.json was written by (its architectures entry; a config
    without one but with a dflash_config block is an older DFlash one)."""
    arch = config.get("architectures") or []
    if arch == [dspark.ARCHITECTURE]:
        return "dspark"
    if arch == [DFLASH_ARCHITECTURE] or (not arch and "dflash_config" in config):
        return "dflash"
    raise ValueError(f"config.json has architectures {arch}: neither {DFLASH_ARCHITECTURE} nor "
                     f"{dspark.ARCHITECTURE}, not a drafter this engine trains")


def dspark_settings(cfg) -> DSparkSettings | None:
    """The trainer's DSparkSettings of a config whose drafter.objective is dspark (None for
    dflash): drafter.block_size, drafter.markov_rank, drafter.gamma (0: the reference's 4), the
    three loss weights and drafter.num_anchors. Not checked here (DSparkSettings.check)."""
    _check(drafter_objective.objective(cfg))
    if not drafter_objective.is_dspark(cfg):
        return None
    ce, tv, conf = drafter_objective.loss_weights(cfg)
    return DSparkSettings(block_size=int(cfg.drafter.block_size),
                          markov_rank=drafter_objective.markov_rank(cfg),
                          gamma=drafter_objective.gamma(cfg), ce_weight=ce, tv_weight=tv,
                          conf_weight=conf, num_anchors=int(cfg.drafter.num_anchors))


def new_drafter(objective: str, target_config, *, num_layers: int, target_layer_ids: list[int],
                block_size: int, mask_token_id: int, dspark_settings: DSparkSettings | None = None,
                **widths) -> DFlashDrafter:
    """A freshly initialised drafter shaped like the target (seed torch first). DSpark takes its
    block size from ``dspark_settings`` (default DSparkSettings()); ``block_size`` is DFlash's.
    ``widths``: hidden_size, intermediate_size, num_attention_heads, num_key_value_heads."""
    _check(objective)
    if objective == "dspark":
        cfg = build_dspark_config(target_config, num_layers=num_layers,
                                  target_layer_ids=target_layer_ids, mask_token_id=mask_token_id,
                                  settings=dspark_settings or DSparkSettings(), **widths)
        return DSparkDrafter(cfg)
    cfg = build_drafter_config(target_config, num_layers=num_layers,
                               target_layer_ids=target_layer_ids, block_size=block_size,
                               mask_token_id=mask_token_id, **widths)
    return DFlashDrafter(cfg)


def drafter_from_config(config: dict, objective: str, where: str = "the checkpoint"):
    """An uninitialised drafter of a checkpoint's config.json (load its weights next); raises
    ObjectiveMismatch when the config is the other kind's."""
    _check(objective)
    found = objective_of(config)
    if found != objective:
        raise ObjectiveMismatch(where, found, objective)
    cls = _CLASSES[objective]
    return cls(cls.config_from_dict(config))


def load_drafter(folder: str | Path, objective: str):
    """A drafter from a model folder (``drafter.init_from``) of the run's objective."""
    _check(objective)
    folder = Path(folder)
    found = objective_of(json.loads((folder / "config.json").read_text()))
    if found != objective:
        raise ObjectiveMismatch(str(folder), found, objective)
    return _CLASSES[objective].load(folder)
