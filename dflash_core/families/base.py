"""What a drafter family is, read from the config alone and without torch: the config, the
memory plan, preflight and the checkpoint size use it before anything loads. Its drafter class
(models/<family>/) answers the same questions for a built drafter.

``d`` below is a config's drafter section (``cfg.drafter``).
"""

from __future__ import annotations

from typing import NamedTuple


class Problem(NamedTuple):
    """A setting that cannot work: the key to change, what is wrong, and the fix."""

    key: str
    message: str
    hint: str


class Memorise(NamedTuple):
    """How ``dflash-tui check`` memorises its samples with a family (check/memorise.py): the
    check trains on the target's own greedy text and then decodes it exactly, so what it needs
    memorised is the argmax of every slot, in the family's own terms."""

    share: float = 0.97  # memorised: teacher-forced tau reaches this share of its ceiling
    # then trained on toward this share, for as many steps again at most: exact decoding's few
    # rounds (16 of block 8 on 2 x 64 tokens) lose a whole block to one wrong slot, and at 97%
    # an MXFP4 gpt-oss decoded at 88-89% of full blocks in either family, at 99% at 95-100%
    aim: float = 0.99
    keys: dict = {}  # drafter.* values the memorise phase trains with instead of the config's
    why: str = ""  # why they differ, said on the console and kept in check.json


class Family:
    """A drafter family; the defaults are DFlash's (a family says only what differs)."""

    name = ""  # drafter.objective
    title = ""  # "a DFlash drafter": how a refusal names a checkpoint of it
    architecture = ""  # the architectures entry of its config.json
    # The anchor slot predicts too: B inputs give B drafts and B+1 labels, not B-1 and B.
    anchor_predicts = False
    # The target sends its post-norm last hidden state after the k layer features.
    last_hidden = False
    # drafter.* keys whose default is the family's own when a config does not set them.
    defaults: dict = {}
    # Bytes per logit of one live loss chunk (the memory plan).
    loss_bytes_per_logit = 8
    # Whether its loss has the fused path (models/fused_loss) that drafter.fused_loss selects.
    has_fused_loss = True

    def owns(self, config: dict) -> bool:
        """Whether a drafter config.json was written by this family."""
        return (config.get("architectures") or []) == [self.architecture]

    def settings(self, d):
        """The family's settings beyond the drafter section's shared keys (None: none)."""
        return None

    def refusals(self, d) -> list[Problem]:
        """Keys that never combine with this family, whatever the target: the config refuses
        them when it loads, preflight and the trainer again for configs built otherwise."""
        return []

    def problems(self, d, vocab: int | None = None) -> list[Problem]:
        """The family's settings that cannot work with a target of ``vocab`` tokens."""
        return []

    def label_width(self, d) -> int:
        """Width of the block labels the loaders prepare (replica.prepare_batch)."""
        return int(d.block_size) + int(self.anchor_predicts)

    def drafts_per_round(self, block_size: int) -> int:
        return block_size - 1 + int(self.anchor_predicts)

    def feature_vectors(self, k: int) -> int:
        """H-vectors per token the target sends the drafter for its k feature layers."""
        return k + int(self.last_hidden)

    def fused_loss_bytes(self, d, chunk_rows: int, rows: int, hidden: int, vocab: int,
                         head_bytes: int) -> int:
        """What the fused loss (models/fused_loss) holds at its peak: one chunk's logits in the
        lm_head's dtype (``head_bytes`` each; the kernel writes their gradient over them) and,
        from forward to backward, the gradient of each of the micro-group's ``rows`` rows."""
        return chunk_rows * vocab * head_bytes + rows * hidden * head_bytes

    def layer_saved_h(self, d) -> float:
        """What its layer saves for backward beyond DFlash's, per block token per layer, in
        2-byte units of the width H (planning/drafter_memory.py's DRAFTER_SAVED_* count
        DFlash's)."""
        return 0.0

    def head_params(self, d, hidden: int, vocab: int) -> int:
        """Trainable parameters the family adds to the shared backbone."""
        return 0

    def frozen_numel(self, d, hidden: int, vocab: int) -> int:
        """Elements of the target's tensors its served folder carries (frozen, not state)."""
        return 0

    def recipe(self, drafter: dict) -> str:
        """The family in the recipe's words ("" when it is the plain one)."""
        return ""

    def memorise(self, d) -> Memorise:
        """The check's memorise phase for this family: DFlash's cross-entropy on the data's
        tokens learns the argmax as it is, with the config's settings."""
        return Memorise()
