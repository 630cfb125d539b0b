"""The training recipe a config chose, in words (the start of the logs, the report's summary)."""

from __future__ import annotations

from dflash_core.config.schema import default_gamma
from dflash_core.families.registry import FAMILIES


def recipe_text(config: dict) -> str:
    """The training recipe a config (as a dict) chose: drafter.loss and optim.name with their
    rates, in words, for the start of the logs and the report's summary, so that runs which
    differ in it say so; "" when the config does not say."""
    drafter, optim = config.get("drafter") or {}, config.get("optim") or {}
    if not isinstance(drafter, dict) or not isinstance(optim, dict):
        return ""
    parts = []
    loss = drafter.get("loss")
    family = FAMILIES.get(drafter.get("objective", "dflash"))
    if family is not None and family.recipe(drafter):
        parts.append(family.recipe(drafter))
        loss = None  # the family's own loss; drafter.loss (dflash / dpace) does not apply
    if loss == "dpace":
        parts.append(f"loss dpace (alpha {drafter.get('dpace_alpha', '?')}; its loss figures "
                     "are D-PACE-weighted, not comparable with the dflash loss)")
    elif loss:
        gamma = drafter.get("gamma") or (default_gamma(int(drafter["block_size"]))
                                         if drafter.get("block_size") else None)
        parts.append(f"loss {loss}" + (f" (gamma {gamma:g})" if gamma else ""))
    name = optim.get("name")
    if name == "muon":
        parts.append(f"optimizer muon (muon_lr {optim.get('muon_lr') or optim.get('lr', '?')}, "
                     f"AdamW lr {optim.get('lr', '?')} on the norms)")
    elif name:
        parts.append(f"optimizer {name}" + (f" (lr {optim['lr']})" if "lr" in optim else ""))
    return "; ".join(parts)
