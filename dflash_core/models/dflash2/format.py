"""The DFlash2 folder as vLLM reads it (docs/checkpoint-format.md, DFlash2).

- config.json: DFlash's (the drafter's Qwen3 config, ``num_target_layers``, the rotary settings
  in both spellings, the serving keys of models/served_keys.py stated: ``is_causal: false``, the
  block bidirectional) with ``architectures: ["DFlash2DraftModel"]`` and in ``dflash_config``,
  beside DFlash's ``target_layer_ids``, ``block_size`` and ``mask_token_id``, the four keys vLLM
  requires: ``conv_kernel_size``, ``conv_group_size``, ``selector_rank`` and ``selector_top_k``.
  vLLM does not read ``block_size``: a server must be given ``num_speculative_tokens = B - 1``
  (the card says so). A folder's ``is_causal: true`` is honoured (its block attends causally),
  and a top-level ``mask_token_id`` (or ``target_layer_ids``, ``block_size``) read as vLLM does.
- model.safetensors: DFlash's keys and, per layer, ``layers.i.{attention,mlp}_conv.base_kernel``
  [2, T, H] and ``...kernel_projection.weight`` [2TM, H]; ``candidate_selector.hidden_projection
  .weight`` [r, H], ``candidate_selector.predecessor_codebook`` and ``..successor_codebook``
  [V, r] without a ``.weight`` suffix. No embedding nor lm_head: both are the target's.

The folder is the drafter's own state_dict: its module names are the served ones.
"""

from __future__ import annotations

from dflash_core.families.dflash2 import ARCHITECTURE
from dflash_core.models.served_keys import with_fallbacks

# The dflash_config keys vLLM requires of a DFlash2 folder (KeyError there without them).
REQUIRED = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
# Read with these defaults when absent (vLLM's and the reference's).
OPTIONAL = {"output_multiplier": 1.0, "final_logit_softcapping": 0.0,
            "input_embedding_scale": 1.0}


class NotDFlash2(ValueError):
    """A config.json that is not a DFlash2 drafter this engine can load."""


def full_vocabulary_refusal(vocab: int, target_vocab: int) -> str | None:
    """The one line refusing a drafter whose vocabulary is not the target's (None: the same)."""
    if int(vocab) == int(target_vocab):
        return None
    return (f"DFlash2 needs the target's full vocabulary: the drafter has {vocab} tokens, the "
            f"target {target_vocab} (its candidates are the target lm_head's top-K and its "
            "codebooks are indexed by target ids; a reduced draft vocabulary cannot serve)")


def serve_config_of(config, dflash_serve_config_of) -> dict:
    """config.json of a DFlash2 drafter config: DFlash's (``dflash_serve_config_of``: its
    serving keys stated, ``is_causal`` among them) with DFlash2's architecture and its
    dflash_config keys."""
    out = dflash_serve_config_of(config)
    out["architectures"] = [ARCHITECTURE]
    dc = dict(out["dflash_config"])
    for k in REQUIRED:
        dc[k] = int(dc[k])
    out["dflash_config"] = dc
    return out


def check_serve_dict(d: dict) -> dict:
    """The served config.json's dflash_config (the keys vLLM also finds at the top level taken
    from there), checked: NotDFlash2 naming the key for anything this engine cannot load (the
    serving keys every family shares are judged by served_keys.read)."""
    arch = d.get("architectures")
    if arch != [ARCHITECTURE]:
        raise NotDFlash2(f"config.json has architectures {arch}, not [{ARCHITECTURE!r}]: not a "
                         "DFlash2 drafter")
    if not isinstance(d.get("dflash_config"), dict):
        raise NotDFlash2("DFlash2 config.json has no dflash_config block")
    dc = with_fallbacks(d)
    missing = [k for k in ("target_layer_ids", "mask_token_id") + REQUIRED if k not in dc]
    if missing:
        raise NotDFlash2(f"DFlash2 config.json lacks dflash_config.{', '.join(missing)}: not a "
                         "complete DFlash2 drafter folder")
    scale = dc.get("input_embedding_scale", 1.0)
    if scale != 1.0:
        raise NotDFlash2(f"dflash_config.input_embedding_scale {scale}: this engine feeds the "
                         "target's embeddings unscaled (1)")
    top_k, vocab = dc.get("selector_top_k"), d.get("vocab_size")
    if isinstance(top_k, int) and isinstance(vocab, int) and not 1 <= top_k <= vocab:
        raise NotDFlash2(f"dflash_config.selector_top_k {top_k}: the selector picks among the "
                         f"top-K of the {vocab} tokens, so K must be 1..{vocab}")
    draft_vocab = d.get("draft_vocab_size")
    if draft_vocab is not None and "vocab_size" in d:
        refused = full_vocabulary_refusal(draft_vocab, d["vocab_size"])
        if refused:
            raise NotDFlash2(refused)
    return dc


def check_tensor_names(names) -> None:
    """The selector's codebooks are plain tensors, named without ``.weight`` as vLLM reads them:
    a folder that names them otherwise (written by another tool from an nn.Embedding) would not
    serve, so it is refused in one line naming the tensors."""
    wrong = sorted(n for n in names if n.endswith("_codebook.weight"))
    if wrong:
        raise NotDFlash2(f"model.safetensors names the selector's codebooks {wrong}: vLLM reads "
                         "them without '.weight' (candidate_selector.predecessor_codebook, "
                         "candidate_selector.successor_codebook); rename those tensors, or "
                         "publish the folder again from its checkpoint")
