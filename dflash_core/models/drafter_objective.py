"""Which objective a config trains (``drafter.objective``: "dflash" | "dspark") and the sizes that
follow from it, read from the config alone and without torch: the memory plan, the checkpoint
size and preflight use them before anything loads (drafter_kinds.dspark_settings builds the
trainer's DSparkSettings from the same values).

DSpark's keys (``drafter.markov_rank``, ``drafter.ce_weight``, ``drafter.tv_weight``,
``drafter.conf_weight``) are read with the reference's defaults when a config has none.
"""

from __future__ import annotations

OBJECTIVES = ("dflash", "dspark")
# The reference's released DSpark configs (DSparkSettings' defaults; a test keeps them equal).
DSPARK_BLOCK_SIZE = 7
DSPARK_MARKOV_RANK = 256
DSPARK_GAMMA = 4.0
DSPARK_LOSS_WEIGHTS = (0.1, 0.9, 1.0)  # CE, TV, confidence
# DSpark's loss holds 3.3-4.4 float32 chunk x V arrays at its peak (docs/algorithm.md, DSpark):
# a smaller chunk than DFlash's 4096 keeps it near DFlash's (2.1 / 3.5 GiB at 8B / 27B shapes).
DSPARK_LOSS_CHUNK = 1024


def objective(cfg) -> str:
    """The config's drafter.objective ("dflash" when the config has no such key)."""
    return str(getattr(cfg.drafter, "objective", "dflash"))


def is_dspark(cfg) -> bool:
    return objective(cfg) == "dspark"


def markov_rank(cfg) -> int:
    return int(getattr(cfg.drafter, "markov_rank", DSPARK_MARKOV_RANK))


def loss_weights(cfg) -> tuple[float, float, float]:
    d, (ce, tv, conf) = cfg.drafter, DSPARK_LOSS_WEIGHTS
    return (float(getattr(d, "ce_weight", ce)), float(getattr(d, "tv_weight", tv)),
            float(getattr(d, "conf_weight", conf)))


def gamma(cfg) -> float:
    """DSpark's slot-weight decay: drafter.gamma, 0 meaning the reference's 4."""
    return float(cfg.drafter.gamma or DSPARK_GAMMA)


def confidence_head(cfg) -> bool:
    """DSpark trains (and saves) a confidence head unless its loss weight is 0."""
    return loss_weights(cfg)[2] > 0


def label_width(cfg) -> int:
    """Width of the block labels the loaders prepare (replica.prepare_batch): B for DFlash, B+1
    for DSpark (its slot j is labelled with the token at anchor+j+1; DSparkDrafter.label_width)."""
    return int(cfg.drafter.block_size) + int(is_dspark(cfg))


def feature_vectors(cfg, k: int) -> int:
    """H-vectors per token the target sends the drafter: its k layer features, and for DSpark
    its post-norm last hidden state after them."""
    return k + int(is_dspark(cfg))


def dspark_head_params(cfg, hidden: int, vocab: int) -> int:
    """Trainable parameters DSpark adds to the drafter: the Markov head's W1 [V, r] and W2
    [V, r], and the confidence head's [1, H + r] weight and bias (0 for DFlash)."""
    if not is_dspark(cfg):
        return 0
    r = markov_rank(cfg)
    return 2 * r * vocab + ((hidden + r + 1) if confidence_head(cfg) else 0)


def frozen_numel(cfg, hidden: int, vocab: int) -> int:
    """Elements of the frozen copies a DSpark checkpoint's model.safetensors carries (the
    target's embed_tokens and lm_head, each [V, H]; 0 for DFlash, whose folder has neither)."""
    return 2 * vocab * hidden if is_dspark(cfg) else 0
