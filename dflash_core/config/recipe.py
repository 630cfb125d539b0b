"""The training recipe a config chose, in words (the start of the logs, the report's summary)."""

from __future__ import annotations

from dflash_core.config.schema import default_gamma


def recipe_text(config: dict) -> str:
    """The training recipe a config (as a dict) chose: drafter.loss and optim.name with their
    rates, in words, for the start of the logs and the report's summary, so that runs which
    differ in it say so; "" when the config does not say."""
    drafter, optim = config.get("drafter") or {}, config.get("optim") or {}
    if not isinstance(drafter, dict) or not isinstance(optim, dict):
        return ""
    parts = []
    loss = drafter.get("loss")
    if drafter.get("objective") == "dspark":
        weights = [drafter.get(k, "?") for k in ("ce_weight", "tv_weight", "conf_weight")]
        parts.append(f"objective dspark (B {drafter.get('block_size', '?')}, Markov rank "
                     f"{drafter.get('markov_rank', '?')}, loss {weights[0]} CE + {weights[1]} TV "
                     f"+ {weights[2]} confidence, gamma {drafter.get('gamma') or 4:g})")
        loss = None  # its loss is that one; drafter.loss (dflash / dpace) does not apply
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
