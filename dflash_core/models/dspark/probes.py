"""Probes of a trained DSpark drafter whose healthy answers are known on a memorised sample: they
name DSpark's own faults (for ``dflash-tui check``).

- **layout**: slot j must predict the token at anchor+j+1 (anchor-as-first). A drafter trained
  or served off by one predicts the token at its own position, anchor+j (DFlash's layout; slot 0
  then copies the anchor instead of predicting).
- **Markov input**: the head must get the token of slot j-1 (the anchor for slot 0). Teacher-forced
  accuracy with that input must beat the same with the input one position late, or the anchor for
  every slot; if a wrong input scores better, training fed the head the wrong token.
- **chain**: decoding's chain (the drafted token into the Markov head) must propose exactly the
  argmax the training pass gives with the chain's own tokens as inputs; a difference means
  decoding feeds the head otherwise than training does.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from dflash_core.models.dspark import loss as dl
from dflash_core.models.objective import IGNORE


@dataclass
class DSparkProbes:
    accuracy: list[float]  # per slot: argmax = label (token at anchor+j+1), inputs as trained
    own_position: list[float]  # per slot: argmax = token at anchor+j (the off-by-one layout)
    prev_late: float  # accuracy with the Markov input one position late (anchor-1 for slot 0)
    prev_anchor: float  # accuracy with the anchor as every slot's Markov input
    chain_differs: float  # share of blocks whose chain proposal differs from the training pass
    anchors: list[int] = field(default_factory=list)

    @property
    def mean_accuracy(self) -> float:
        return sum(self.accuracy) / max(1, len(self.accuracy))

    def faults(self, margin: float = 0.1) -> list[str]:
        """The faults the evidence names, in words (empty when healthy)."""
        return [what for what, _ in self.fault_fixes(margin)]

    def fault_fixes(self, margin: float = 0.1) -> list[tuple[str, str]]:
        """(fault, its fix) for each fault the evidence names (``dflash-tui check``'s findings)."""
        out = []
        if sum(self.own_position) > sum(self.accuracy) + margin * len(self.accuracy):
            out.append(("slot 0 is not predicting: slot j predicts the token at its own position "
                        "(DFlash's layout), not the one after it (anchor-as-first)",
                        "slot j must be labelled with the token at anchor+j+1 "
                        "(dspark_loss.dspark_targets on labels one slot wider, "
                        "DSparkDrafter.label_width) and served with dspark_bonus_anchor false"))
        if max(self.prev_late, self.prev_anchor) > self.mean_accuracy + margin:
            out.append(("the Markov head is fed the wrong previous token: a shifted or constant "
                        "input predicts better than the token of the slot before",
                        "train the head on the anchor token for slot 0 and the token at "
                        "anchor+j for slot j (dspark_loss.dspark_targets' prev)"))
        if self.chain_differs > 0:
            out.append(("decoding's chain feeds the Markov head otherwise than training: "
                        f"{self.chain_differs:.0%} of the probed blocks propose differently",
                        "decoding must feed slot j's Markov input the token just drafted for "
                        "slot j-1, the anchor for slot 0 (DSparkDrafter.chain_draft)"))
        return out

    def describe(self) -> str:
        """One evidence line: accuracy per slot against the label and the slot's own token,
        with the Markov input shifted or constant, and the chain against training."""
        def slots(v):
            return " ".join(f"{x:.2f}" for x in v)
        return (f"DSpark probes at anchors {self.anchors}: per slot right {slots(self.accuracy)}"
                f"; equal to the slot's own token {slots(self.own_position)}; with the Markov "
                f"input one late {self.prev_late:.2f}, the anchor for every slot "
                f"{self.prev_anchor:.2f}; chain proposals unlike training's "
                f"{self.chain_differs:.0%}")


def _mean_hits(preds, labels) -> float:
    has = labels != IGNORE
    return float(((preds == labels) & has).sum()) / max(1, int(has.sum()))


@torch.no_grad()
def probe(drafter, features: torch.Tensor, input_ids: torch.Tensor, anchors: list[int]
          ) -> DSparkProbes:
    """features: [1, T, k*H] of ``input_ids`` [T] (a memorised sample); ``anchors``: positions
    in its trained part with at least one token after them."""
    dev = next(drafter.parameters()).device
    ids = input_ids.reshape(1, -1).to(dev)
    T = ids.shape[1]
    feats = features[:1, :T].to(dev)
    at = torch.tensor([sorted(anchors)], device=dev)
    B = drafter.block_size
    ones = torch.ones_like(ids)
    labels, prev = dl.dspark_targets(dl.wide_labels(ids, ones, at, B), dl.anchor_tokens(ids, at))
    bids, pos = drafter.block_inputs(ids, at)
    hidden = drafter(feats, drafter.embed_tokens(bids).to(drafter.fc.weight.dtype), pos, at)
    preds = dl.teacher_forced_preds(drafter, hidden, prev)

    own = torch.full_like(labels, IGNORE)  # the token at anchor+j, where labels has one
    slot_pos = at[..., None] + torch.arange(B, device=dev)
    own = torch.where(labels != IGNORE, ids[0, slot_pos.clamp(max=T - 1)], own)
    late = torch.cat([ids[0, (at - 1).clamp(min=0)][..., None], prev[..., :-1]], -1)
    const = prev[..., :1].expand_as(prev)
    accuracy = [_mean_hits(preds[..., j], labels[..., j]) for j in range(B)]
    own_position = [_mean_hits(preds[..., j], own[..., j]) for j in range(B)]
    prev_late = _mean_hits(dl.teacher_forced_preds(drafter, hidden, late), labels)
    prev_anchor = _mean_hits(dl.teacher_forced_preds(drafter, hidden, const), labels)

    differs = 0
    for i, a in enumerate(at[0].tolist()):
        chain = drafter.chain_draft(feats[:, :a], int(ids[0, a])).tokens
        chain_prev = torch.cat([ids[0, a: a + 1], chain[:-1]])[None, None]
        again = dl.teacher_forced_preds(drafter, hidden[:, i * B: (i + 1) * B], chain_prev)
        differs += int(not torch.equal(again.reshape(-1), chain))
    return DSparkProbes(accuracy, own_position, prev_late, prev_anchor,
                        differs / max(1, len(anchors)), [int(a) for a in at[0]])
