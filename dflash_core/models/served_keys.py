"""The config.json keys beyond a drafter's shape that change what vLLM computes of a DFlash,
DFlash2 or DSpark folder, each honoured or refused here, for every reader of a folder (eval's
``--drafter``, ``drafter.init_from``, a resume, publish): a folder is never decoded one way here
and served another (docs/checkpoint-format.md, "Keys a server reads").

vLLM's reading (its DFlash drafter model, which DFlash2's and DSpark's Qwen3 drafters build on,
and its auxiliary-layer lookup), and this engine's answer:

- **causality of the block**: ``is_causal`` (every layer), else ``dflash_config.causal``, else a
  layer is causal when ``layer_types`` calls it ``sliding_attention``. Causal: a block position
  attends to the context and to the block's positions up to its own; otherwise to the whole
  block. Honoured (block_attention.py computes both); sliding layers are refused below, so the
  default is bidirectional.
- **sliding windows**: ``layer_types`` with ``sliding_attention``, or ``dflash_config.use_swa``
  true (every layer, window ``swa_window_size`` or ``sliding_window``). Refused: this engine's
  drafter layers attend to the whole context. ``swa_window_size`` alone changes nothing.
- **attention sinks**: ``dflash_config.attention_sink_bias`` (else a top-level
  ``add_swa_attention_sink_bias``) true adds a learned per-head sink. Refused.
- **rotary layout**: ``is_neox_style`` (default true: the halves of a head rotate together, as
  here). False (interleaved pairs) is refused.
- **feature layers**: ``eagle_aux_hidden_state_layer_ids`` first, else
  ``dflash_config.target_layer_ids``, else ``dspark_target_layer_ids``, else a top-level
  ``target_layer_ids``; the eagle ids count one past this engine's (id L: the output of target
  layer L - 1). Honoured: the ids decoded are the ones vLLM reads.
- **DFlash and DSpark logits**: ``logit_scale`` other than 1 scales them (refused); a
  ``draft_vocab_size`` below the vocabulary maps a reduced vocabulary (refused).
  ``use_aux_hidden_state`` false drops ``fc`` (refused). DSpark's ``dspark_draft_topk``
  applies its Markov head to the top candidates only (refused).
- **the anchor slot**: DFlash and DFlash2 refuse ``dflash_config.sample_from_anchor`` true (vLLM
  too). DSpark reads ``sample_from_anchor`` (default true: anchor-first, B slots, slot j drafts
  the token at anchor + j + 1); false, or an older ``dspark_bonus_anchor`` true, is the 1+N
  layout (speculators-style: the anchor an input only, slot j drafts anchor + j): refused.
- ``attention_bias`` true gives the projections biases this engine's drafter has not: refused.

``mask_token_id`` and ``block_size`` are read from ``dflash_config``, else from the top level
(vLLM reads the mask id so; it reads no block size). A folder holding ``mask_embedding.pt``
(vLLM puts that vector in the mask token's place) is refused by ``check_files``.

Writers state every key with the value this engine computes (``stated``): a reader never falls
back on a default of its own.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

SLIDING = "sliding_attention"
FULL = "full_attention"
MASK_EMBEDDING = "mask_embedding.pt"  # vLLM's separately trained mask vector, beside the weights
# What a reader drops once judged: the values live in the drafter's config (dflash_config) and
# the writer states them again.
JUDGED = ("is_causal", "is_neox_style", "eagle_aux_hidden_state_layer_ids",
          "dspark_target_layer_ids", "add_swa_attention_sink_bias", "logit_scale",
          "use_aux_hidden_state", "sample_from_anchor", "dspark_bonus_anchor",
          "dspark_draft_topk")
_DC_JUDGED = ("causal", "use_swa", "swa_window_size", "attention_sink_bias",
              "eagle_aux_hidden_state_layer_ids", "use_aux_hidden_state", "sample_from_anchor")
# dflash_config's keys vLLM (or the reference) also finds at the top level
_FALLBACK = ("mask_token_id", "target_layer_ids", "block_size")


class ServedKeyRefused(ValueError):
    """A config.json key whose served meaning this engine cannot compute: one line naming the
    key, its value and what this engine supports."""


@dataclass(frozen=True)
class ServedKeys:
    """What a folder's config.json says beyond its shape, as vLLM reads it."""

    causal: bool  # the block's positions attend only to themselves and those before
    target_layer_ids: list[int] | None  # this engine's numbering (layer i's output); None: none
    layer_ids_from: str  # the key they were read from


def _refuse(key: str, value, why: str) -> ServedKeyRefused:
    import json

    try:
        shown = json.dumps(value)
    except (TypeError, ValueError):
        shown = repr(value)
    return ServedKeyRefused(f"config.json's {key} {shown}: {why}")


def _flag(where: dict, key: str, shown: str):
    """A true/false key, or None when absent; anything else refused (vLLM would read "false"
    as true)."""
    v = where.get(key)
    if v is None or isinstance(v, bool):
        return v
    raise _refuse(shown, v, "must be true or false: this engine reads no other value (vLLM "
                            "would take any string as true)")


def _ids(value, key: str, offset: int) -> list[int]:
    ok = isinstance(value, list) and value and all(
        isinstance(i, int) and not isinstance(i, bool) for i in value)
    if not ok:
        raise _refuse(key, value, "must be a non-empty list of the target's layer numbers")
    ids = [int(i) - offset for i in value]
    if min(ids) < 0:
        raise _refuse(key, value, "id 0 is the target's embedding output; this engine's "
                                  "drafters read the outputs of target layers only (ids >= 1)"
                      if offset else "layer numbers are >= 0")
    return ids


def with_fallbacks(d: dict) -> dict:
    """``d``'s dflash_config with the keys it lacks taken from the top level, as vLLM finds
    them (mask_token_id, target_layer_ids; block_size, which SpecForge and the public
    reference write at the top level)."""
    dc = d.get("dflash_config")
    dc = dict(dc) if isinstance(dc, dict) else {}
    for k in _FALLBACK:
        if k not in dc and k in d:
            dc[k] = d[k]
    return dc


def _causal(d: dict, dc: dict) -> bool:
    top = _flag(d, "is_causal", "is_causal")
    if top is not None:
        return top
    inner = _flag(dc, "causal", "dflash_config.causal")
    return bool(inner)  # absent: causal only for sliding layers, refused in _attention


def _attention(d: dict, dc: dict) -> None:
    kinds = d.get("layer_types")
    if kinds is not None:
        if not isinstance(kinds, list):
            raise _refuse("layer_types", kinds, "a list of the layers' attention kinds expected")
        other = sorted({str(k) for k in kinds if k != FULL})
        if other:
            raise _refuse("layer_types", other, "drafter layers of type " + ", ".join(other)
                          + f"; this engine's drafter layers are {FULL} (no sliding window)")
    if _flag(dc, "use_swa", "dflash_config.use_swa"):
        window = dc.get("swa_window_size", d.get("sliding_window"))
        raise _refuse("dflash_config.use_swa", True, f"vLLM gives every layer a sliding window "
                      f"(of {window}); this engine's drafter layers attend to the whole context "
                      "(use_swa false)")
    # dflash_config's key, else the top-level one of other drafters (MiMo's)
    sink_key, sink = (("dflash_config.attention_sink_bias", dc["attention_sink_bias"])
                      if "attention_sink_bias" in dc else
                      ("add_swa_attention_sink_bias", d.get("add_swa_attention_sink_bias")))
    if sink:
        raise _refuse(sink_key, sink, "a learned attention sink per head; this engine's drafter "
                                      "attention has none (false)")
    if _flag(d, "is_neox_style", "is_neox_style") is False:
        raise _refuse("is_neox_style", False, "interleaved rotary pairs; this engine rotates a "
                                              "head's two halves (true, vLLM's default)")
    if d.get("attention_bias"):
        raise _refuse("attention_bias", d["attention_bias"], "projection biases; this engine's "
                                                             "drafter attention has none (false)")


def _layer_ids(d: dict, dc: dict) -> tuple[list[int] | None, str]:
    """vLLM's lookup of the target layers a drafter reads, in this engine's numbering."""
    eagle = d.get("eagle_aux_hidden_state_layer_ids")
    if eagle:
        return _ids(eagle, "eagle_aux_hidden_state_layer_ids", 1), \
            "eagle_aux_hidden_state_layer_ids"
    for key, where in (("target_layer_ids", dc), ("dspark_target_layer_ids", d)):
        if where.get(key):
            return _ids(where[key], key, 0), key
    return None, ""  # none named: the callers that need them refuse (eval's check_fields)


def _logits(d: dict, family: str) -> None:
    if family in ("dflash", "dspark"):
        scale = d.get("logit_scale", 1.0)
        if scale != 1 and scale != 1.0:
            raise _refuse("logit_scale", scale, "vLLM scales the drafter's logits by it; this "
                                                "engine's are unscaled (1)")
        draft = d.get("draft_vocab_size")
        if draft is not None and "vocab_size" in d and draft != d["vocab_size"]:
            raise _refuse("draft_vocab_size", draft, f"a reduced draft vocabulary mapped onto "
                          f"the target's {d['vocab_size']} ids; this engine drafts over the "
                          "target's whole vocabulary")
    if family == "dspark" and d.get("dspark_draft_topk") is not None:
        raise _refuse("dspark_draft_topk", d["dspark_draft_topk"], "vLLM applies the Markov "
                      "head to the top candidates of the base logits only; this engine applies "
                      "it to the whole vocabulary (leave it out)")


def _aux(d: dict, dc: dict) -> None:
    eagle = d.get("eagle_config") if isinstance(d.get("eagle_config"), dict) else {}
    merged = {**eagle, **dc}
    aux = merged.get("use_aux_hidden_state", d.get("use_aux_hidden_state", True))
    if aux is not True and not aux:
        raise _refuse("use_aux_hidden_state", aux, "the drafter would read the target's last "
                      "hidden state without fc; this engine's drafters read their target layers "
                      "through fc (true)")


def _anchor(d: dict, dc: dict, family: str) -> None:
    if family == "dspark":
        first = _flag(d, "sample_from_anchor", "sample_from_anchor")
        bonus = _flag(d, "dspark_bonus_anchor", "dspark_bonus_anchor")
        if first is False or bonus:
            key, value = (("sample_from_anchor", False) if first is False
                          else ("dspark_bonus_anchor", True))
            raise _refuse(key, value, "a 1+N block (the anchor an input only, slot j drafting "
                          "anchor + j, as speculators writes it); this engine's DSpark is "
                          "anchor-first (sample_from_anchor true: B slots, slot j drafting "
                          "anchor + j + 1)")
    elif _flag(dc, "sample_from_anchor", "dflash_config.sample_from_anchor"):
        raise _refuse("dflash_config.sample_from_anchor", True, "the anchor is the bonus token "
                      f"of a {'DFlash2' if family == 'dflash2' else 'DFlash'} block, never a "
                      "prediction: this engine drafts from the mask slots (false; vLLM refuses "
                      "true too)")


def read(d: dict, family: str) -> tuple[dict, ServedKeys]:
    """(``d`` without the keys judged here, what they say); ServedKeyRefused for a key whose
    served meaning this engine cannot compute. ``family``: "dflash", "dflash2" or "dspark"."""
    dc = with_fallbacks(d) if family != "dspark" else (
        d["dflash_config"] if isinstance(d.get("dflash_config"), dict) else {})
    _attention(d, dc)
    _aux(d, dc)
    _logits(d, family)
    _anchor(d, dc, family)
    causal = _causal(d, dc)
    if family == "dspark":  # its entries are top-level; dflash_config (rare) is vLLM's first
        ids, where = _layer_ids(d, {"target_layer_ids": dc.get("target_layer_ids")
                                    or d.get("target_layer_ids")})
    else:
        ids, where = _layer_ids(d, dc)
    rest = {k: v for k, v in d.items() if k not in JUDGED}
    named = {"target_layer_ids": ids} if ids is not None else {}
    if family == "dspark":
        rest |= named
    else:  # the drafter's dflash_config: the ids decoded and the block's causality
        rest["dflash_config"] = {**{k: v for k, v in dc.items() if k not in _DC_JUDGED},
                                 **named, "causal": causal}
    return rest, ServedKeys(causal, ids, where)


def stated(family: str, causal: bool) -> tuple[dict, dict]:
    """(top-level keys, dflash_config keys) a folder of ``family`` this engine writes states,
    with the values it computes (DSpark has no dflash_config: its keys are all top-level)."""
    top = {"is_causal": bool(causal), "is_neox_style": True}
    if family == "dspark":
        return {**top, "add_swa_attention_sink_bias": False, "sample_from_anchor": True,
                "dspark_bonus_anchor": False}, {}
    return top, {"causal": bool(causal), "use_swa": False, "attention_sink_bias": False}


def unstated(config: dict, family: str) -> dict:
    """The keys of ``stated`` a config.json (one this engine wrote) leaves out, with the values
    its reader resolves (an older checkpoint's: publish adds them). Keys under dflash_config
    are named ``dflash_config.KEY``."""
    _, keys = read(config, family)
    top, inner = stated(family, keys.causal)
    missing = {k: v for k, v in top.items() if k not in config}
    dc = config.get("dflash_config") if isinstance(config.get("dflash_config"), dict) else {}
    missing |= {f"dflash_config.{k}": v for k, v in inner.items() if k not in dc}
    return missing


def check_files(folder: Path, family: str) -> None:
    """A DFlash or DFlash2 folder with ``mask_embedding.pt`` beside its weights (vLLM feeds that
    vector in the mask token's place) is refused."""
    if family != "dspark" and (Path(folder) / MASK_EMBEDDING).exists():
        raise ServedKeyRefused(f"the folder holds {MASK_EMBEDDING}: vLLM feeds that vector in "
                               "the mask token's place; this engine feeds the target's "
                               "embedding of mask_token_id (remove the file, or evaluate it "
                               "with vLLM)")
