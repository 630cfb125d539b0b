"""The one registry of drafter families: drafter.objective -> its Family (torch-free; the
drafter classes of each are registered beside it in models/registry.py). A new family is one
Family here and one drafter class there."""

from __future__ import annotations

from dflash_core.families.base import Family, Problem
from dflash_core.families.dflash import DFLASH
from dflash_core.families.dflash2 import DFLASH2
from dflash_core.families.dspark import DSPARK

FAMILIES: dict[str, Family] = {f.name: f for f in (DFLASH, DSPARK, DFLASH2)}
OBJECTIVES = tuple(FAMILIES)
# Keys whose default some family chooses: a config that sets the objective without them gets
# that family's value (the field's own default otherwise).
FAMILY_DEFAULT_KEYS = tuple(dict.fromkeys(k for f in FAMILIES.values() for k in f.defaults))

__all__ = ["FAMILIES", "OBJECTIVES", "Family", "Problem", "family", "family_of", "objective",
           "objective_of"]


def family(name: str) -> Family:
    if name not in FAMILIES:
        raise ValueError(f"drafter.objective {name!r}: use one of {', '.join(OBJECTIVES)}")
    return FAMILIES[name]


def objective(cfg) -> str:
    """The config's drafter.objective ("dflash" when the config has no such key)."""
    return str(getattr(cfg.drafter, "objective", "dflash"))


def family_of(cfg) -> Family:
    """The Family a config trains."""
    return family(objective(cfg))


def objective_of(config: dict) -> str:
    """The objective a drafter config.json was written by."""
    for f in FAMILIES.values():
        if f.owns(config):
            return f.name
    arch = config.get("architectures") or []
    raise ValueError(f"config.json has architectures {arch}: neither "
                     f"{' nor '.join(f.architecture for f in FAMILIES.values())}, not a drafter "
                     "this engine trains")


# The config-level questions the plans ask, answered by the config's family.
def settings(cfg):
    """The family's settings of a config (DSparkSettings for dspark; None for dflash)."""
    return family_of(cfg).settings(cfg.drafter)


def label_width(cfg) -> int:
    return family_of(cfg).label_width(cfg.drafter)


def feature_vectors(cfg, k: int) -> int:
    return family_of(cfg).feature_vectors(k)


def head_params(cfg, hidden: int, vocab: int) -> int:
    return family_of(cfg).head_params(cfg.drafter, hidden, vocab)


def frozen_numel(cfg, hidden: int, vocab: int) -> int:
    return family_of(cfg).frozen_numel(cfg.drafter, hidden, vocab)
