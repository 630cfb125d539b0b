"""DFlash's step loss as a replica runs it on one micro-group: cross-entropy on the data's
tokens with the paper's slot weights (drafter.loss dflash) or D-PACE's (dpace); the pieces are
models/objective.py's."""

from __future__ import annotations

import torch

from dflash_core.config import DrafterConfig, default_gamma
from dflash_core.models import objective as obj
from dflash_core.models.fused_loss import select as fused_loss


class DFlashStepLoss:
    """``stats``: the names of the loss terms a step sums beside the shared statistics (none)."""

    stats: tuple[str, ...] = ()

    def __init__(self, drafter, dcfg: DrafterConfig, settings=None):
        if settings is not None:
            raise ValueError(f"{type(settings).__name__} given for a DFlash drafter")
        self.settings = None
        self.gamma = dcfg.gamma or default_gamma(drafter.block_size)
        self.dpace_alpha = dcfg.dpace_alpha if dcfg.loss == "dpace" else None
        self.chunk = dcfg.loss_chunk
        self.fused_mode = dcfg.fused_loss  # resolved per device: the drafter's is known later

    def check_features(self, drafter, features: torch.Tensor) -> None:
        """DFlash takes the k layer features as they come."""

    def targets(self, drafter, feats, labels, input_ids,
                anchors) -> tuple[torch.Tensor, obj.GroupTargets]:
        """The drafter's input features and the group's labelled slots (host labels)."""
        return feats, obj.GroupTargets(labels, obj.label_rows(labels, self.gamma,
                                                              self.dpace_alpha))

    def __call__(self, drafter, hidden, pos, labels, t: obj.GroupTargets) -> obj.LossOut:
        return obj.chunked_loss(hidden, labels, drafter.lm_head.weight, self.gamma, self.chunk,
                                rows=t.picked,
                                fused=fused_loss.fused(self.fused_mode, hidden.device.type))
