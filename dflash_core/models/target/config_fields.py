"""The fields of a target's config.json checked before anything uses them.

A target's config.json is input: the memory plan (target/shape.py, planning/weight_bytes.py), the
preflight checks and the loader read widths, depths, head and expert counts, layer kinds and the
quantization block from it, and divide by some of them. A negative width, a block size of 0 or a
string where an object belongs would otherwise end deep in the plan as an internal error. Here each
field those read is checked once, where the file is first read (preflight's target checks and the
loader's), and the first bad one is named with its file: ``<path>: <field> <value>: <rule>``.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

HINT = ("restore the model folder's config.json (download the model again), or set target.path "
        "to an intact model folder")
# Read by the plan, each a whole number > 0 where present (text model level).
POSITIVE = ("num_key_value_heads", "head_dim", "max_position_embeddings",
            "full_attention_interval")
NON_NEGATIVE = ("n_shared_experts", "shared_expert_intermediate_size", "first_k_dense_replace")
FLAGS = ("attention_bias", "mlp_bias", "use_qk_norm", "tie_word_embeddings")
EXPERT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")  # as target/shape.py
TOP_K_KEYS = ("num_experts_per_tok", "experts_per_token", "moe_topk")
GDN_KEYS = ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
            "linear_value_head_dim", "linear_conv_kernel_dim")
VISION_POSITIVE = ("hidden_size", "intermediate_size", "num_hidden_layers", "patch_size",
                   "image_size")
DTYPE_NAMES = ("auto", "float16", "bfloat16", "float32", "float64", "half", "float", "double",
               "float8_e4m3fn", "float8_e5m2", "int8", "uint8")


class ConfigFieldError(ValueError):
    """A field of a target's config.json that nothing may use; the message names file and
    field. Preflight makes it a ConfigError (target.path), the loader a TargetLoadError."""


def check_config_fields(hf_config: dict, path: Path | str) -> None:
    """Raise ConfigFieldError naming ``path`` and the first field of ``hf_config`` (a parsed
    config.json) that the plan, preflight or the loader cannot use."""
    try:
        _check(hf_config)
    except _Bad as bad:
        raise ConfigFieldError(f"{path}: {bad}") from None


class _Bad(Exception):
    pass


def _show(value: Any) -> str:
    try:
        text = json.dumps(value)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


class _Fields:
    """One level of the config (the top, ``text_config``, ``quantization_config`` ...), with the
    prefix its fields are named by."""

    def __init__(self, data: dict, prefix: str = ""):
        self.data, self.prefix = data, prefix

    def bad(self, key: str, rule: str) -> _Bad:
        return _Bad(f"{self.prefix}{key} {_show(self.data.get(key))}: {rule}")

    def get(self, key: str) -> Any:
        return self.data.get(key)

    def whole(self, key: str, least: int = 1, required: bool = False,
              why: str = "") -> int | None:
        value = self.data.get(key)
        if value is None:
            if required:
                raise _Bad(f"'{self.prefix}{key}' is missing{why or ''}: it must be a whole "
                           f"number > {least - 1}")
            return None
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise self.bad(key, f"must be a whole number > {least - 1}"
                           if least else "must be a whole number >= 0")
        return value

    def number(self, key: str) -> None:
        value = self.data.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                  or not math.isfinite(value) or value <= 0):
            raise self.bad(key, "must be a number > 0")

    def flag(self, key: str) -> None:
        if self.data.get(key) is not None and not isinstance(self.data[key], bool):
            raise self.bad(key, "must be true or false")

    def text(self, key: str) -> str | None:
        value = self.data.get(key)
        if value is not None and not isinstance(value, str):
            raise self.bad(key, "must be a string")
        return value

    def mapping(self, key: str) -> "_Fields | None":
        value = self.data.get(key)
        if value is None:
            return None
        if not isinstance(value, dict):
            raise self.bad(key, "must be an object ({...}) or absent")
        return _Fields(value, f"{self.prefix}{key}.")


def _check(hf_config: dict) -> None:
    top = _Fields(hf_config)
    nested = top.mapping("text_config")
    text = nested if nested is not None and nested.data else top
    for level in {id(top): top, id(text): text}.values():
        level.text("model_type")
        level.flag("tie_word_embeddings")
        _dtype(level)
        _quantization(level)
    top.mapping("auto_map")
    _text_model(text)
    vision = top.mapping("vision_config")
    if vision is not None:
        for key in VISION_POSITIVE:
            vision.whole(key)
        vision.flag("vision_use_head")


def _dtype(level: _Fields) -> None:
    for key in ("torch_dtype", "dtype"):
        value = level.get(key)
        if value is not None and (not isinstance(value, str)
                                  or value.removeprefix("torch.") not in DTYPE_NAMES):
            raise level.bad(key, "must name a dtype (bfloat16, float16, float32)")


def _quantization(level: _Fields) -> None:
    quant = level.mapping("quantization_config")
    if quant is None:
        return
    method = quant.get("quant_method")
    if not isinstance(method, str) or not method:
        if method is None:
            raise _Bad(f"'{quant.prefix}quant_method' is missing: a quantization_config names "
                       "its method (fp8, mxfp4, ...)")
        raise quant.bad("quant_method", "must be the method's name (fp8, mxfp4, ...)")
    block = quant.get("weight_block_size")
    if block is not None and not (
            isinstance(block, list) and len(block) == 2
            and all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in block)):
        raise quant.bad("weight_block_size",
                        "must be [rows, columns] of a block, each entry a whole number > 0")


def _text_model(tc: _Fields) -> None:
    hidden = tc.whole("hidden_size", required=True)
    layers = tc.whole("num_hidden_layers", required=True)
    heads = tc.whole("num_attention_heads", required=True)
    vocab = tc.whole("vocab_size", required=True)
    for key in POSITIVE:
        tc.whole(key)
    for key in NON_NEGATIVE:
        tc.whole(key, least=0)
    for key in FLAGS:
        tc.flag(key)
    kv = tc.get("num_key_value_heads")
    if kv and heads % kv:
        raise tc.bad("num_key_value_heads", f"must divide num_attention_heads ({heads})")
    mla = _mla(tc)
    if tc.get("head_dim") is None and not mla and hidden % heads:
        raise tc.bad("hidden_size", f"must be a multiple of num_attention_heads ({heads}) "
                                    "when the config names no head_dim")
    _experts(tc, layers)
    types = _layer_types(tc, layers)
    if "linear_attention" in types:
        for key in GDN_KEYS:
            tc.whole(key, required=True, why=" (the Gated DeltaNet layers' size)")
    else:
        for key in GDN_KEYS:
            tc.whole(key, least=0)
    for key in ("rms_norm_eps", "rope_theta"):
        tc.number(key)
    tc.mapping("rope_scaling")
    rope = tc.mapping("rope_parameters")
    if rope is not None:
        rope.number("rope_theta")
    _token_ids(tc, vocab)


def _mla(tc: _Fields) -> bool:
    """Multi-head latent attention's widths (DeepSeek-V3, Kimi-K2): all there when
    kv_lora_rank > 0."""
    kv_lora = tc.whole("kv_lora_rank", least=0) or 0
    tc.whole("q_lora_rank", least=0)
    if not kv_lora:
        return False
    why = " (multi-head latent attention: kv_lora_rank > 0)"
    tc.whole("qk_rope_head_dim", required=True, why=why)
    tc.whole("qk_nope_head_dim", least=0, required=True, why=why)
    tc.whole("v_head_dim", required=True, why=why)
    return True


def _experts(tc: _Fields, layers: int) -> None:
    counts = [tc.whole(key, least=0) for key in EXPERT_KEYS]
    experts = next((n for n in counts if n is not None), 0)
    tops = [(key, tc.whole(key, least=0)) for key in TOP_K_KEYS]
    dense = tc.get("intermediate_size")
    if experts:
        tc.whole("decoder_sparse_step")
        moe_width = tc.whole("moe_intermediate_size")
        tc.whole("intermediate_size")
        if moe_width is None and dense is None:
            raise _Bad(f"'{tc.prefix}moe_intermediate_size' is missing: a mixture of experts "
                       "names its experts' width, a whole number > 0")
        key, top = next(((k, n) for k, n in tops if n is not None), (None, None))
        if key is not None and not 1 <= top <= experts:
            raise tc.bad(key, f"must be a whole number from 1 to the {experts} experts")
    else:
        tc.whole("decoder_sparse_step", least=0)
        tc.whole("moe_intermediate_size", least=0)
        tc.whole("intermediate_size", required=True)
    only = tc.get("mlp_only_layers")
    if only is not None and not (isinstance(only, list) and all(
            isinstance(i, int) and not isinstance(i, bool) and 0 <= i < layers for i in only)):
        raise tc.bad("mlp_only_layers", f"must be a list of layer ids 0..{layers - 1}")


def _layer_types(tc: _Fields, layers: int) -> list:
    types = tc.get("layer_types")
    if not types:
        return []
    if not isinstance(types, list):
        raise tc.bad("layer_types", "must be a list with one kind per layer")
    known = _known_layer_kinds()
    for i, kind in enumerate(types):
        if not isinstance(kind, str) or (known and kind not in known):
            raise _Bad(f"{tc.prefix}layer_types[{i}] {_show(kind)}: must be a layer kind such as "
                       "full_attention, sliding_attention or linear_attention")
    if len(types) != layers:
        raise _Bad(f"{tc.prefix}layer_types: {len(types)} kinds for num_hidden_layers {layers}: "
                   "must name one per layer")
    return types


def _known_layer_kinds() -> tuple:
    """The layer kinds transformers knows (its config check), with the legacy names it maps."""
    try:
        from transformers import configuration_utils as cu
    except ImportError:  # pragma: no cover - transformers is a dependency
        return ()
    return tuple(getattr(cu, "ALLOWED_LAYER_TYPES", ())) + tuple(
        getattr(cu, "_LEGACY_LAYER_TYPE_REMAP", {}))


def _token_ids(tc: _Fields, vocab: int) -> None:
    """The end-of-sequence id(s) the evaluation stops on: inside the vocabulary."""
    value = tc.get("eos_token_id")
    ids = value if isinstance(value, list) else [value]
    if value is not None and not all(
            isinstance(i, int) and not isinstance(i, bool) and 0 <= i < vocab for i in ids):
        raise tc.bad("eos_token_id", f"must be a token id (or a list of them) 0..{vocab - 1}")
