"""The drafter's rotary position settings: the target's, written the way serving stacks read them.

The drafter rotates queries and keys with the target's settings: its theta, its scaling (YaRN,
linear, dynamic NTK, llama3, longrope) and the window that scaling stretches
(``original_max_position_embeddings``; ``max_position_embeddings`` is copied beside them). A
position then means to the drafter what it means to the target at every length the target is
served at. transformers' Qwen3 rotary embedding computes them from ``rope_parameters``
(``ROPE_INIT_FUNCTIONS``), in training and in the reference alike.

config.json says them twice, alike: ``rope_parameters`` (transformers 5) and ``rope_theta`` +
``rope_scaling`` (transformers 4, and serving code that reads those two keys: SGLang's DFlash
drafter takes rope_theta 1e6 when the key is absent, transformers 5's Qwen3 10000). A reader
given both keeps ``rope_scaling`` (transformers 5 does), another ``rope_parameters``, so a file
whose two spellings differ is refused (RopeConflict) rather than read one way here and another
there.

Not carried: ``partial_rotary_factor`` and the multimodal sections (``mrope_section``): the
drafter's attention rotates whole heads over text positions, where multimodal RoPE is the plain
one. A target whose settings differ per layer kind (Gemma 3) gives its ``full_attention`` ones:
the drafter attends to its whole context. The drafter's own layers are all full attention (no
sliding window), as it trains, whatever the target's window.
"""

from __future__ import annotations

from typing import Any

# The keys of each scaling kind (transformers' validation lists them); others are not carried.
SCALING_KEYS = ("factor", "original_max_position_embeddings", "attention_factor", "beta_fast",
                "beta_slow", "mscale", "mscale_all_dim", "truncate", "low_freq_factor",
                "high_freq_factor", "short_factor", "long_factor")
DEFAULT = "default"
FULL_ATTENTION = "full_attention"
# The theta a drafter took when the target named none (Qwen3's released models' value).
FALLBACK_THETA = 1_000_000.0


class RopeConflict(ValueError):
    """config.json's rope_parameters and rope_theta / rope_scaling say different things."""


def _known_kinds() -> tuple[str, ...]:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    return (DEFAULT, *ROPE_INIT_FUNCTIONS)


def _field(config: Any, key: str) -> Any:
    return config.get(key) if isinstance(config, dict) else getattr(config, key, None)


def _flat(rope: dict) -> dict:
    """One layer kind's settings of a per-kind mapping (``{"full_attention": {...}, ...}``)."""
    if "rope_type" in rope or "type" in rope or "rope_theta" in rope:
        return rope
    kinds = {k: v for k, v in rope.items() if isinstance(v, dict)}
    if not kinds:
        return rope
    return kinds.get(FULL_ATTENTION) or next(iter(kinds.values()))


def _normal(rope: dict, theta: Any) -> dict:
    """One spelling: rope_type, rope_theta and the kind's scaling keys (none for the default)."""
    kind = rope.get("rope_type") or rope.get("type") or DEFAULT
    if kind == "mrope":  # a multimodal target's text positions: the plain rotation
        kind = DEFAULT
    if kind not in _known_kinds():
        raise ValueError(f"rope_type {kind!r} is none that transformers computes "
                         f"({', '.join(_known_kinds())})")
    theta = rope.get("rope_theta", theta)
    out = {"rope_type": kind, "rope_theta": None if theta is None else float(theta)}
    if kind != DEFAULT:
        out.update({k: rope[k] for k in SCALING_KEYS if rope.get(k) is not None})
    return out


def config_rope(config: Any) -> dict | None:
    """The rotary settings a config says (a config.json dict, or a transformers config, whose
    ``rope_scaling`` is an alias of its ``rope_parameters``), in one spelling: ``rope_type``,
    ``rope_theta`` (None: not said) and the scaling keys. None when it says nothing. Raises
    RopeConflict when a dict's two spellings differ."""
    top_theta = _field(config, "rope_theta")
    params = _field(config, "rope_parameters")
    new = _normal(_flat(params), top_theta) if isinstance(params, dict) and params else None
    legacy = None
    if isinstance(config, dict):
        scaling = config.get("rope_scaling")
        if (isinstance(scaling, dict) and scaling) or top_theta is not None:
            legacy = _normal(scaling if isinstance(scaling, dict) else {}, top_theta)
    if new is not None and legacy is not None and new != legacy:
        raise RopeConflict(f"rope_parameters says {new}, rope_theta + rope_scaling say "
                           f"{legacy}: serving stacks read one or the other")
    return new or legacy


def drafter_rope(target_config: Any) -> dict:
    """The settings a drafter of this target takes (its language model's): the target's."""
    from dflash_core.models.target.shape import text_config

    rope = config_rope(text_config(target_config)) or {"rope_type": DEFAULT, "rope_theta": None}
    if rope["rope_theta"] is None:
        rope["rope_theta"] = FALLBACK_THETA
    return rope


def served_keys(rope: dict) -> dict:
    """config.json's rotary entries: ``rope_parameters``, and the same settings as
    ``rope_theta`` + ``rope_scaling`` (None for the plain rotation)."""
    scaling = None if rope["rope_type"] == DEFAULT else {
        k: v for k, v in rope.items() if k != "rope_theta"}
    return {"rope_parameters": dict(rope), "rope_theta": rope["rope_theta"],
            "rope_scaling": scaling}


def config_kwargs(d: dict) -> dict:
    """A config.json dict with its rotary entries in one spelling (``rope_parameters``), for
    building a Qwen3Config: transformers would otherwise prefer ``rope_scaling``. Raises
    RopeConflict when the two spellings differ."""
    rope = config_rope(d)
    out = {k: v for k, v in d.items() if k not in ("rope_parameters", "rope_theta",
                                                   "rope_scaling")}
    if rope is not None:
        out["rope_parameters"] = {k: v for k, v in rope.items() if v is not None}
    return out
