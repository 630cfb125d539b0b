"""DFlash (docs/algorithm.md): the anchor slot is input only, B inputs give B-1 drafts, trained
with cross-entropy on the data's tokens (drafter.loss: dflash or dpace)."""

from __future__ import annotations

from dflash_core.families.base import Family

ARCHITECTURE = "DFlashDraftModel"


class DFlashFamily(Family):
    name = "dflash"
    title = "a DFlash drafter"
    architecture = ARCHITECTURE
    # Chunked cross-entropy, per logit of one chunk (each chunk is recomputed in backward, so
    # one is live): bf16 logits 2 + float32 upcast 4 + bf16 grad 2; the log-softmax and float32
    # grad are not all live with them.
    loss_bytes_per_logit = 8

    def owns(self, config: dict) -> bool:
        # A config without architectures but with a dflash_config block is an older DFlash one.
        arch = config.get("architectures") or []
        return arch == [ARCHITECTURE] or (not arch and "dflash_config" in config)


DFLASH = DFlashFamily()
