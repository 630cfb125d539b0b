"""The drafter's optimizer (``optim.name``): AdamW on every trainable parameter, or Muon on the
2-D weight matrices with AdamW on the rest.

Muon (``torch.optim.Muon``, in torch since 2.9) orthogonalises each matrix's momentum with a few
Newton-Schulz iterations; it is defined for matrices only, so the vectors (every RMSNorm weight:
the layers' norms, q_norm / k_norm, hidden_norm, the final norm) stay on AdamW. ``fc``, the
k*H -> H projection of the target features, goes to Muon: it is a dense linear map of
continuous inputs whose whole gradient is dense, like the layers' own projections. (Muon's
advice keeps embeddings and output heads on AdamW: a lookup table updates only the rows it saw,
and a head maps onto the vocabulary; the drafter trains neither.) Muon scales its learning rate
per matrix to match AdamW's update size (Moonshot's ``match_rms_adamw``), so ``optim.muon_lr``
means the same at the demo's width and at 27B's.

Both kinds of optimizer present one state dict of torch's usual form (``state`` by parameter
index, ``param_groups`` listing those indices), so checkpoints store either the same way.
"""

from __future__ import annotations

import inspect

import torch
from torch import nn

from dflash_core.config import ConfigError, OptimConfig

# Moonshot's per-matrix scaling: lr * 0.2 * sqrt(max(rows, cols)) makes the orthogonalised
# update's RMS that of a typical AdamW update, so AdamW's learning rate carries over.
MUON_ADJUST_LR = "match_rms_adamw"


def muon_class() -> type:
    """torch.optim.Muon, or a ConfigError saying this torch lacks it (or its lr scaling)."""
    muon = getattr(torch.optim, "Muon", None)
    if muon is None:
        raise ConfigError("optim.name", f"muon needs torch.optim.Muon, which torch "
                          f"{torch.__version__} does not have (it came with torch 2.9)",
                          hint="set optim.name: adamw, or install torch 2.9 or newer")
    if "adjust_lr_fn" not in inspect.signature(muon).parameters:
        raise ConfigError("optim.name", f"torch {torch.__version__}'s torch.optim.Muon has no "
                          "adjust_lr_fn (its per-matrix learning-rate scaling)",
                          hint="set optim.name: adamw, or install a newer torch")
    return muon


def split_params(drafter: nn.Module, params: list[nn.Parameter]
                 ) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """(Muon's, AdamW's) among ``params``: the 2-D weight matrices, and everything else. The
    order within each is the module's, so every replica builds the same state layout. Modules
    named in the drafter's ``adamw_only`` (DSpark's Markov head, a lookup table and a map onto
    the vocabulary, and its one-row confidence head) stay on AdamW whatever their shape."""
    wanted = {id(p) for p in params}
    keep = tuple(f"{m}." for m in getattr(drafter, "adamw_only", ()))
    matrices, rest = [], []
    for name, p in drafter.named_parameters():
        if id(p) in wanted:
            (matrices if p.ndim == 2 and not name.startswith(keep) else rest).append(p)
    return matrices, rest


def _adamw(params, o: OptimConfig, device: torch.device) -> torch.optim.AdamW:
    return torch.optim.AdamW(params, lr=o.lr, betas=tuple(o.betas), weight_decay=o.weight_decay,
                             fused=device.type == "cuda")


class MuonAdamW:
    """Muon on the matrices and AdamW on the rest, stepped together, with one state dict."""

    def __init__(self, matrices: list[nn.Parameter], rest: list[nn.Parameter], o: OptimConfig,
                 device: torch.device):
        self.muon = muon_class()(matrices, lr=o.muon_lr or o.lr, weight_decay=o.weight_decay,
                                 adjust_lr_fn=MUON_ADJUST_LR)
        self.parts = [self.muon]
        self.adamw = _adamw(rest, o, device) if rest else None
        if self.adamw is not None:
            self.parts.append(self.adamw)

    @property
    def param_groups(self) -> list[dict]:
        return [g for part in self.parts for g in part.param_groups]

    @property
    def state(self) -> dict:
        return {p: s for part in self.parts for p, s in part.state.items()}

    def step(self) -> None:
        for part in self.parts:
            part.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for part in self.parts:
            part.zero_grad(set_to_none)

    def state_dict(self) -> dict:
        """Muon's groups first, then AdamW's, parameter indices running on across both (as one
        optimizer over both groups would number them)."""
        state, groups, offset = {}, [], 0
        for part in self.parts:
            sd = part.state_dict()
            state.update({int(i) + offset: s for i, s in sd["state"].items()})
            groups += [{**g, "params": [int(i) + offset for i in g["params"]]}
                       for g in sd["param_groups"]]
            offset += sum(len(g["params"]) for g in sd["param_groups"])
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, sd: dict) -> None:
        groups = list(sd["param_groups"])
        if len(groups) != len(self.param_groups):
            raise ValueError(f"the state has {len(groups)} parameter groups, this optimizer "
                             f"{len(self.param_groups)}")
        offset = 0
        for part in self.parts:
            mine, groups = groups[: len(part.param_groups)], groups[len(part.param_groups):]
            count = sum(len(g["params"]) for g in mine)
            part.load_state_dict({
                "state": {int(i) - offset: s for i, s in sd["state"].items()
                          if offset <= int(i) < offset + count},
                "param_groups": [{**g, "params": [int(i) - offset for i in g["params"]]}
                                 for g in mine]})
            offset += count


def build_optimizer(drafter: nn.Module, params: list[nn.Parameter], o: OptimConfig,
                    device: torch.device):
    """The optimizer ``optim.name`` names, over ``params`` (the drafter's trainable ones)."""
    if o.name == "muon":
        matrices, rest = split_params(drafter, params)
        return MuonAdamW(matrices, rest, o, device)
    return _adamw(params, o, device)


def set_lr(optimizer, o: OptimConfig, scale: float) -> None:
    """This step's learning rates: ``scale`` (the schedule's factor, objective.lr_at over
    optim.lr) times optim.lr for AdamW's groups and optim.muon_lr for Muon's. From the config
    each step, so a resume takes the config's rates, not the checkpoint's."""
    muon = optimizer.muon.param_groups if isinstance(optimizer, MuonAdamW) else []
    for g in optimizer.param_groups:
        g["lr"] = scale * ((o.muon_lr or o.lr) if any(g is m for m in muon) else o.lr)


def state_name(trainer_state: dict) -> str:
    """The optimizer a checkpoint's trainer state was written with (absent: AdamW, the only one
    before optim.name existed)."""
    return str(trainer_state.get("optimizer", "adamw"))
