"""DSpark's step loss as a replica runs it on one micro-group (loss.py holds the math): the
features end with the target's post-norm last hidden state, the labels are one slot wider and
shift to DSpark's layout, and the step sums its three terms (TERMS) beside the shared
statistics."""

from __future__ import annotations

import torch

from dflash_core.config import ConfigError, DrafterConfig
from dflash_core.families.dspark import DSPARK, DSparkSettings
from dflash_core.models import objective as obj
from dflash_core.models.dspark import loss as dspark_loss
from dflash_core.models.fused_loss import select as fused_loss


class DSparkStepLoss:
    stats: tuple[str, ...] = dspark_loss.TERMS

    def __init__(self, drafter, dcfg: DrafterConfig, settings: DSparkSettings | None = None):
        refused = DSPARK.dpace_refusal(dcfg)  # written once, in the family
        if refused is not None:
            raise ConfigError(refused.key, refused.message, hint=refused.hint)
        # The config's settings, or the reference's with the drafter's own block size and rank.
        self.settings = (settings or DSparkSettings(block_size=drafter.block_size,
                                                    markov_rank=drafter.markov_rank)).check()
        self.gamma = self.settings.gamma
        self.chunk = dcfg.loss_chunk
        self.fused_mode = dcfg.fused_loss  # resolved per device: the drafter's is known later

    def check_features(self, drafter, features: torch.Tensor) -> None:
        """DSpark's features end with the target's post-norm last hidden state: (k+1)*H wide."""
        H, k = drafter.config.hidden_size, len(drafter.target_layer_ids)
        if features.shape[-1] != (k + 1) * H:
            raise ValueError(f"DSpark needs the target's post-norm last hidden state after its "
                             f"{k} layer features ({(k + 1) * H} values per token), got "
                             f"{features.shape[-1]}: the target stage must append it")

    def targets(self, drafter, feats, labels, input_ids, anchors):
        H = drafter.config.hidden_size
        feats, last = feats[..., :-H], feats[..., -H:]
        labels, prev = dspark_loss.dspark_targets(labels,
                                                  dspark_loss.anchor_tokens(input_ids, anchors))
        return feats, obj.GroupTargets(labels, dspark_loss.label_rows(labels, self.gamma),
                                       (last, prev))

    def __call__(self, drafter, hidden, pos, labels, t: obj.GroupTargets):
        last, prev = t.extra
        s = self.settings
        return dspark_loss.dspark_loss(
            hidden, last, pos, labels, prev.to(hidden.device, non_blocking=True), drafter,
            gamma=self.gamma, chunk=self.chunk, rows=t.picked,
            loss_weights=(s.ce_weight, s.tv_weight, s.conf_weight),
            fused=fused_loss.fused(self.fused_mode, hidden.device.type))
