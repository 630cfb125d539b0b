"""DFlash2 (docs/algorithm.md "DFlash2"): DFlash's drafter with every attention and MLP sublayer
wrapped in a grouped dynamic causal convolution over block positions, and a candidate selector
(the top-K of the unary logits, a low-rank predecessor-to-candidate score, a greedy walk) in
place of the per-slot argmax. The anchor slot is input only (B inputs give B-1 drafts), as in
DFlash. Trained with DFlash's block loss + alpha x a K-way cross-entropy over the draft's own
top-K candidates with the previous token teacher-forced.

Its defaults are written here once: the public trainers' (B = 8, T = 2 taps, groups of 16
channels, rank 256, K = 16, alpha 1). DFlash2Settings, the config's keys (config/schema.py) and
the objective's default of drafter.block_size read them.
"""

from __future__ import annotations

from dataclasses import dataclass

from dflash_core.families.base import Family, Problem

ARCHITECTURE = "DFlash2DraftModel"
BLOCK_SIZE = 8
CONV_KERNEL_SIZE = 2
CONV_GROUP_SIZE = 16
SELECTOR_RANK = 256
SELECTOR_TOP_K = 16
SELECTOR_ALPHA = 1.0
# What the selector term does with a label outside the draft's top-K: "drop" the position
# (SpecForge, NeMo Automodel) or "inject" it as the K-th candidate (speculators). drop is the
# default: measured on the demo, a tie at K 16 and drop ahead on every seed at K 2
# (bench/BENCHMARKS.md, "DFlash2 against DFlash and DSpark on the demo").
SELECTOR_MISSING = ("drop", "inject")
SELECTOR_MISSING_DEFAULT = "drop"
# The torch loss's chunk holds its float32 logits, their softmax in backward and the bf16 logits
# and gradient (the selector's K columns are small beside them).
LOSS_BYTES_PER_LOGIT = 12


@dataclass(frozen=True)
class DFlash2Settings:
    """What shapes DFlash2 beyond DFlash's keys: the defaults are the public trainers'."""

    block_size: int = BLOCK_SIZE  # B: the anchor and B-1 drafts
    conv_kernel_size: int = CONV_KERNEL_SIZE  # T: taps of the block-position convolution
    conv_group_size: int = CONV_GROUP_SIZE  # G: channels sharing one dynamic coefficient
    selector_rank: int = SELECTOR_RANK  # r: the codebooks' and the context gate's rank
    selector_top_k: int = SELECTOR_TOP_K  # K: unary candidates per slot
    selector_alpha: float = SELECTOR_ALPHA  # weight of the selector's K-way cross-entropy
    selector_missing: str = SELECTOR_MISSING_DEFAULT  # a label outside the top-K: drop / inject

    def problems(self, vocab_size: int | None = None, hidden_size: int | None = None
                 ) -> list[str]:
        """One line per setting that cannot work, naming it and the fix; empty when all fit."""
        out = []
        if self.block_size < 2:
            out.append(f"drafter.block_size {self.block_size} does not fit DFlash2: a block needs "
                       "the anchor and at least one draft (the public drafters use 8)")
        if self.conv_kernel_size < 1:
            out.append(f"drafter.conv_kernel_size {self.conv_kernel_size} does not fit: the "
                       "convolution needs at least one tap (the public drafters use 2)")
        if self.conv_group_size < 1:
            out.append(f"drafter.conv_group_size {self.conv_group_size} does not fit: a group "
                       "needs at least one channel (the public drafters use 16)")
        elif hidden_size is not None and hidden_size % self.conv_group_size:
            out.append(f"drafter.conv_group_size {self.conv_group_size} does not fit: it must "
                       f"divide the drafter's width {hidden_size} (the public drafters use 16)")
        if self.selector_rank < 1:
            out.append(f"drafter.selector_rank {self.selector_rank} does not fit: the codebooks "
                       "need a rank of at least 1 (the public drafters use 256)")
        if self.selector_top_k < 1:
            out.append(f"drafter.selector_top_k {self.selector_top_k} does not fit: the selector "
                       "needs at least one candidate (the public drafters use 16)")
        elif vocab_size is not None and self.selector_top_k > vocab_size:
            out.append(f"drafter.selector_top_k {self.selector_top_k} does not fit: it exceeds "
                       f"the target's vocabulary ({vocab_size})")
        if self.selector_alpha < 0:
            out.append(f"drafter.selector_alpha {self.selector_alpha} does not fit: the selector "
                       "term's weight cannot be negative (the public trainers use 1)")
        if self.selector_missing not in SELECTOR_MISSING:
            out.append(f"drafter.selector_missing {self.selector_missing!r}: use one of "
                       f"{', '.join(SELECTOR_MISSING)}")
        return out

    def check(self, vocab_size: int | None = None, hidden_size: int | None = None
              ) -> "DFlash2Settings":
        bad = self.problems(vocab_size, hidden_size)
        if bad:
            raise ValueError(bad[0])
        return self

    def conv_params(self, hidden: int, layers: int) -> int:
        """Both convolutions of every layer: base kernels [2, T, H] and projections [2TM, H]."""
        T, M = self.conv_kernel_size, hidden // max(1, self.conv_group_size)
        return layers * 2 * (2 * T * hidden + 2 * T * M * hidden)

    def selector_params(self, hidden: int, vocab: int) -> int:
        """The context gate [r, H] and the two codebooks [V, r] (2 x V x r: 127M at V 248320,
        r 256)."""
        r = self.selector_rank
        return r * hidden + 2 * vocab * r


class DFlash2Family(Family):
    name = "dflash2"
    title = "a DFlash2 drafter"
    architecture = ARCHITECTURE
    defaults = {"block_size": BLOCK_SIZE}
    loss_bytes_per_logit = LOSS_BYTES_PER_LOGIT

    def layer_saved_h(self, d) -> float:
        """Beyond DFlash's layer, in 2-byte H units per block token, under bf16 autocast
        (models/dflash2/conv.py): the convolutions save each sublayer's normed input (cast once)
        and each sublayer's output, 4 in all; the side-0 outputs are what the projections save
        (one for q/k/v, one for gate/up) in place of DFlash's five casts of the normed inputs,
        3 fewer; and both sublayers' coefficients Delta, 2 x 2TM = 4T/G. 1.5 at T 2, G 16, as
        measured on the CPU (tests/core/models/dflash2/test_conv.py)."""
        s = self.settings(d)
        return 1.0 + 4.0 * s.conv_kernel_size / max(1, s.conv_group_size)

    def settings(self, d) -> DFlash2Settings:
        """drafter.block_size and the conv and selector keys. Not checked here
        (DFlash2Settings.check)."""
        return DFlash2Settings(
            block_size=int(d.block_size),
            conv_kernel_size=int(getattr(d, "conv_kernel_size", CONV_KERNEL_SIZE)),
            conv_group_size=int(getattr(d, "conv_group_size", CONV_GROUP_SIZE)),
            selector_rank=int(getattr(d, "selector_rank", SELECTOR_RANK)),
            selector_top_k=int(getattr(d, "selector_top_k", SELECTOR_TOP_K)),
            selector_alpha=float(getattr(d, "selector_alpha", SELECTOR_ALPHA)),
            selector_missing=str(getattr(d, "selector_missing", SELECTOR_MISSING_DEFAULT)))

    def fused_loss_bytes(self, d, chunk_rows: int, rows: int, hidden: int, vocab: int,
                         head_bytes: int) -> int:
        """models/fused_loss/selector_rows.py at its peak: one chunk's logits in the lm_head's
        dtype (the gradient written over them), per chunk row the K candidates' successor rows
        and their products with the gate (float32, 2 x K x r) and three H-wide rows (the
        gradient back through the head in its dtype, then float32, and the gate's share), and
        from forward to backward the rows' float32 gradients of their states and both
        codebooks' dense float32 gradients (2 x V x r)."""
        s = self.settings(d)
        K, r = s.selector_top_k, s.selector_rank
        return (chunk_rows * (vocab * head_bytes + 8 * K * r + (head_bytes + 8) * hidden)
                + rows * hidden * 4 + 2 * vocab * r * 4 + r * hidden * 4)

    def refusals(self, d) -> list[Problem]:
        out = []
        if getattr(d, "loss", "dflash") == "dpace":
            out.append(Problem(
                "drafter.loss", "dpace does not combine with drafter.objective dflash2 (its "
                "selector term is weighted by DFlash's fixed slot weights; D-PACE's, made from "
                "the step's own cross-entropies, are not defined for it)",
                "set drafter.loss: dflash, or drafter.objective: dflash"))
        return out

    def problems(self, d, vocab: int | None = None) -> list[Problem]:
        hidden = int(getattr(d, "hidden_size", 0) or 0) or None
        out = []
        for line in self.settings(d).problems(vocab, hidden):
            word = line.split(" ", 1)[0]
            key = word if word.startswith("drafter.") else "drafter.objective"
            out.append(Problem(key, line, f"change {key} in config.yaml (docs/algorithm.md, "
                                          "DFlash2)"))
        return out

    def head_params(self, d, hidden: int, vocab: int) -> int:
        """The convolutions of every layer and the selector (its codebooks dominate)."""
        s = self.settings(d)
        return (s.conv_params(hidden, int(getattr(d, "num_layers", 0)))
                + s.selector_params(hidden, vocab))

    def recipe(self, drafter: dict) -> str:
        return (f"objective dflash2 (B {drafter.get('block_size', '?')}, conv "
                f"{drafter.get('conv_kernel_size', '?')} taps x groups of "
                f"{drafter.get('conv_group_size', '?')}, selector rank "
                f"{drafter.get('selector_rank', '?')} top-{drafter.get('selector_top_k', '?')}, "
                f"loss DFlash + {drafter.get('selector_alpha', '?')} x selector CE, labels "
                f"outside the top-K {drafter.get('selector_missing', '?')})")


DFLASH2 = DFlash2Family()
