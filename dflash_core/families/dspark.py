"""DSpark (arXiv 2607.05147, docs/algorithm.md "DSpark"): DFlash's backbone, the anchor slot
predicts too (B inputs give B drafts), a Markov head of rank r and a confidence head, trained
with CE + TV against the target's own distribution + the confidence head's BCE.

Its defaults are written here once: the reference's released configs (B = 7, rank 256, gamma 4,
loss 0.1 CE + 0.9 TV + 1.0 confidence). DSparkSettings, the config's keys (config/schema.py)
and the objective's defaults of drafter.block_size and drafter.loss_chunk all read them.
"""

from __future__ import annotations

from dataclasses import dataclass

from dflash_core.families.base import Family, Memorise, Problem

ARCHITECTURE = "Qwen3DSparkModel"
BLOCK_SIZE = 7
MARKOV_RANK = 256
GAMMA = 4.0
LOSS_WEIGHTS = (0.1, 0.9, 1.0)  # CE, TV, confidence
NUM_ANCHORS = 512
# DSpark's loss holds 3.3-4.4 float32 chunk x V arrays at its peak (docs/algorithm.md, DSpark):
# a smaller chunk than DFlash's 4096 keeps it near DFlash's (2.1 / 3.5 GiB at 8B / 27B shapes).
LOSS_CHUNK = 1024
# Its chunked loss (models/dspark/loss.py) peaks at 3.3-4.4 float32 arrays of chunk x V (the
# drafter's and the target's distributions, their logits and the backward's rebuilt ones;
# measured on an H200 at the 8B and 27B shapes, docs/algorithm.md "DSpark").
LOSS_BYTES_PER_LOGIT = 18
# The check's memorise phase (families/base.Memorise): cross-entropy leads, TV stays in. On an
# untrained target (every tiny test model) the target's distribution is nearly flat (top two
# tokens within 10%), and at the 0.1 CE + 0.9 TV balance the frozen lm_head cannot put the
# label first at every position: teacher-forced tau stops at 93-94% of its ceiling for good
# (Qwen3: 7.98 of 8.56 from step 300 to 1000). With CE 1.0 + TV 0.1 every class of
# docs/targets.md memorises in about 100 steps; TV's path (the target's post-norm state at
# each slot's position) still trains, and the probes check it exactly.
CHECK_WEIGHTS = {"ce_weight": 1.0, "tv_weight": 0.1}


@dataclass(frozen=True)
class DSparkSettings:
    """What selects and shapes DSpark: the defaults are the reference's released configs."""

    block_size: int = BLOCK_SIZE  # B: inputs per block = drafts per round
    markov_rank: int = MARKOV_RANK  # r
    gamma: float = GAMMA  # slot weights exp(-j / gamma), j = 0..B-1
    ce_weight: float = LOSS_WEIGHTS[0]
    tv_weight: float = LOSS_WEIGHTS[1]
    conf_weight: float = LOSS_WEIGHTS[2]  # 0: no confidence head (neither trained nor saved)
    num_anchors: int = NUM_ANCHORS  # recorded in the served config (the reference's loader needs it)

    @property
    def confidence_head(self) -> bool:
        return self.conf_weight > 0

    def problems(self, vocab_size: int | None = None) -> list[str]:
        """One line per setting that cannot work, naming it and the fix; empty when all fit."""
        out = []
        if self.block_size < 1:
            out.append(f"drafter.block_size {self.block_size} does not fit DSpark: a block needs "
                       "at least one slot (the reference uses 7)")
        if self.markov_rank < 1:
            out.append(f"drafter.markov_rank {self.markov_rank} does not fit: the Markov head "
                       "needs a rank of at least 1 (the reference uses 256)")
        elif vocab_size is not None and self.markov_rank > vocab_size:
            out.append(f"drafter.markov_rank {self.markov_rank} does not fit: it exceeds the "
                       f"target's vocabulary ({vocab_size}); a low-rank head needs r < V "
                       "(the reference uses 256)")
        if not self.gamma > 0:
            out.append(f"drafter.gamma {self.gamma} does not fit DSpark: the slot weights "
                       "exp(-j/gamma) need gamma > 0 (the reference uses 4)")
        weights = (self.ce_weight, self.tv_weight, self.conf_weight)
        if min(weights) < 0 or self.ce_weight + self.tv_weight <= 0:
            out.append(f"DSpark loss weights {weights} (CE, TV, confidence) do not fit: none may "
                       "be negative and CE + TV must be positive (the reference uses 0.1, 0.9, "
                       "1.0)")
        return out

    def check(self, vocab_size: int | None = None) -> "DSparkSettings":
        bad = self.problems(vocab_size)
        if bad:
            raise ValueError(bad[0])
        return self


class DSparkFamily(Family):
    name = "dspark"
    title = "a DSpark drafter"
    architecture = ARCHITECTURE
    anchor_predicts = True
    last_hidden = True
    defaults = {"block_size": BLOCK_SIZE, "loss_chunk": LOSS_CHUNK}
    loss_bytes_per_logit = LOSS_BYTES_PER_LOGIT

    def settings(self, d) -> DSparkSettings:
        """drafter.block_size, drafter.markov_rank, drafter.gamma (0: the reference's 4), the
        three loss weights and drafter.num_anchors. Not checked here (DSparkSettings.check)."""
        ce, tv, conf = LOSS_WEIGHTS
        return DSparkSettings(
            block_size=int(d.block_size), markov_rank=int(getattr(d, "markov_rank", MARKOV_RANK)),
            gamma=float(d.gamma or GAMMA), ce_weight=float(getattr(d, "ce_weight", ce)),
            tv_weight=float(getattr(d, "tv_weight", tv)),
            conf_weight=float(getattr(d, "conf_weight", conf)), num_anchors=int(d.num_anchors))

    def fused_loss_bytes(self, d, chunk_rows: int, rows: int, hidden: int, vocab: int,
                         head_bytes: int) -> int:
        """Three logits buffers (the drafter's lm_head and Markov logits, the target's, whose
        buffer takes the gradient), the rows' gradients of their states and Markov embeddings,
        and the Markov head's W2: its copy in the lm_head's dtype, a chunk's gradient in it and
        the float32 sum over chunks."""
        r = int(getattr(d, "markov_rank", MARKOV_RANK))
        return (3 * chunk_rows * vocab * head_bytes + rows * (hidden + r) * head_bytes
                + vocab * r * (4 + 2 * head_bytes))

    def dpace_refusal(self, d) -> Problem | None:
        """drafter.loss dpace: its slot weights presuppose DFlash's unlabelled slot 0."""
        if getattr(d, "loss", "dflash") != "dpace":
            return None
        return Problem(
            "drafter.loss", "dpace does not combine with drafter.objective dspark "
            "(drafter.loss dpace does not apply to its slot weights, exp(-j/gamma) on each "
            "block's surviving prefix: D-PACE's presuppose DFlash's unlabelled slot 0 and plain "
            "cross-entropy)", "set drafter.loss: dflash, or drafter.objective: dflash")

    def refusals(self, d) -> list[Problem]:
        out = [p for p in (self.dpace_refusal(d),) if p is not None]
        s = self.settings(d)
        if s.ce_weight + s.tv_weight <= 0:
            out.append(Problem(
                "drafter.tv_weight", "drafter.ce_weight + drafter.tv_weight must be above 0: "
                "DSpark's loss would train the confidence head alone",
                "set drafter.tv_weight: 0.9 and drafter.ce_weight: 0.1 (the reference's)"))
        return out

    def problems(self, d, vocab: int | None = None) -> list[Problem]:
        out = []
        for line in self.settings(d).problems(vocab):
            word, _, rest = line.partition(" ")
            key, said = (word, rest) if word.startswith("drafter.") else ("drafter.ce_weight", line)
            out.append(Problem(key, said, f"change {key} in config.yaml (docs/algorithm.md, "
                                          "DSpark)"))
        return out

    def head_params(self, d, hidden: int, vocab: int) -> int:
        """The Markov head's W1 [V, r] and W2 [V, r], and the confidence head's [1, H + r]
        weight and bias."""
        s = self.settings(d)
        r = s.markov_rank
        return 2 * r * vocab + ((hidden + r + 1) if s.confidence_head else 0)

    def frozen_numel(self, d, hidden: int, vocab: int) -> int:
        """Its model.safetensors carries the target's embed_tokens and lm_head, each [V, H]."""
        return 2 * vocab * hidden

    def memorise(self, d) -> Memorise:
        s = self.settings(d)
        keys = {k: v for k, v in CHECK_WEIGHTS.items() if getattr(s, k) != v}
        if not keys:
            return Memorise()
        return Memorise(keys=keys, why=(
            f"DSpark memorises with CE {CHECK_WEIGHTS['ce_weight']:g} + TV "
            f"{CHECK_WEIGHTS['tv_weight']:g} (the run trains with {s.ce_weight:g} + "
            f"{s.tv_weight:g}): the check needs the target's greedy token first at every "
            "slot, and TV toward the target's whole distribution holds that back where its top "
            "tokens are close (an untrained target)"))

    def recipe(self, drafter: dict) -> str:
        weights = [drafter.get(k, "?") for k in ("ce_weight", "tv_weight", "conf_weight")]
        return (f"objective dspark (B {drafter.get('block_size', '?')}, Markov rank "
                f"{drafter.get('markov_rank', '?')}, loss {weights[0]} CE + {weights[1]} TV "
                f"+ {weights[2]} confidence, gamma {drafter.get('gamma') or GAMMA:g})")


DSPARK = DSparkFamily()
