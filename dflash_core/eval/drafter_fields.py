"""A drafter's config.json checked field by field before a model is built from it.

A drafter folder is input: every field the loaders read must be there (transformers fills a
missing ``hidden_size`` with 4096, which then looks like a drafter of another target) and make
sense (a block of 0 positions decodes as plain decoding, a negative Markov rank fails deep in
torch). Each refusal is one line naming config.json's field and what it holds.
"""

from __future__ import annotations

import math

from dflash_core.eval.errors import EvalInputError
from dflash_core.models.rope_settings import RopeConflict, config_rope

# What the drafter's shape is built from; transformers' defaults stand in for any left out.
REQUIRED = ("hidden_size", "vocab_size", "num_hidden_layers", "num_attention_heads",
            "intermediate_size")
_POSITIVE = REQUIRED + ("num_key_value_heads", "head_dim")
HINT = ("the folder's config.json is damaged or not a drafter's: copy the drafter folder again "
        "(or fix the field)")


def _whole(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def check_fields(d: dict, objective: str, where: str) -> None:
    """Refuse (EvalInputError) a drafter config.json (``d``, the DFlash keys merged to the top
    level) with a field missing, of the wrong type, or out of range."""
    def bad(key: str, why: str):
        raise EvalInputError(f"{where}: config.json's {key} is {d.get(key)!r}: {why}", hint=HINT)

    keys = REQUIRED + ("block_size", "mask_token_id", "target_layer_ids")
    missing = [k for k in keys + (("markov_rank",) if objective == "dspark" else ())
               if k not in d]
    if missing:
        raise EvalInputError(f"{where}: config.json has no {', '.join(missing)} (a drafter's "
                             "config.json names its shape; left out, transformers' defaults "
                             "would stand in)", hint=HINT)
    for k in _POSITIVE:
        if k in d and d[k] is not None and not (_whole(d[k]) and d[k] > 0):
            bad(k, "must be a whole number above 0")
    heads, kv = d["num_attention_heads"], d.get("num_key_value_heads") or d["num_attention_heads"]
    if heads % kv:
        bad("num_key_value_heads", f"the {heads} attention heads must be a multiple of it")
    if not (_whole(d.get("block_size")) and d["block_size"] >= 2):
        bad("block_size", "a block needs at least 2 positions (the anchor and one draft)")
    if not _whole(d.get("mask_token_id")) or d["mask_token_id"] < 0:
        bad("mask_token_id", "must be a token id (a whole number >= 0)")
    ids = d.get("target_layer_ids")
    if not (isinstance(ids, list) and ids and all(_whole(i) and i >= 0 for i in ids)):
        bad("target_layer_ids", "must be a non-empty list of the target's layer numbers (>= 0)")
    if len(set(ids)) != len(ids):
        bad("target_layer_ids", "names a layer twice")
    depth = d.get("num_target_layers", 0)
    if depth is not None and not (_whole(depth) and depth >= 0):
        bad("num_target_layers", "must be the target's layer count (or 0: not recorded)")
    eps = d.get("rms_norm_eps", 1e-6)
    if not (isinstance(eps, (int, float)) and not isinstance(eps, bool) and eps > 0
            and math.isfinite(eps)):
        bad("rms_norm_eps", "must be a number above 0")
    try:
        config_rope(d)
    except (RopeConflict, ValueError) as exc:
        raise EvalInputError(f"{where}: config.json's rotary settings: {exc}",
                             hint="make rope_parameters and rope_theta / rope_scaling say the "
                                  "same (the drafter's training wrote both alike)") from exc
    if objective == "dspark":
        rank = d.get("markov_rank")
        if not (_whole(rank) and rank >= 1):
            bad("markov_rank", "the Markov head needs a rank of at least 1 (the reference uses "
                               "256)")
        if rank > d["vocab_size"]:
            bad("markov_rank", f"it exceeds the vocabulary ({d['vocab_size']})")
