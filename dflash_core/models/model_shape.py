"""A model's shape read from its config: widths, depth, heads, vocabulary, the kind of each layer,
and the parameter count that follows from them. Nothing is loaded.

The one place that knows which keys of an HF config.json hold what, and that multimodal configs
nest the language model under ``text_config``. The drafter's shape is derived from the target's
and the drafter section of config.yaml, as drafter.py builds it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dflash_core.config import Config

HYBRID_TYPES = ("qwen3_5", "qwen3_5_text")  # Gated DeltaNet + gated full attention layers
QK_NORM_TYPES = ("qwen3", "qwen3_5", "qwen3_5_text")
MOE_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")


def text_config(config: Any) -> Any:
    """The language-model part of a config, a config.json dict or a transformers config object:
    multimodal configs nest it under ``text_config``."""
    if isinstance(config, dict):
        tc = config.get("text_config")
        return tc if isinstance(tc, dict) and tc else config
    return getattr(config, "text_config", None) or config


@dataclass(frozen=True)
class ModelShape:
    """What the parameter count and the memory plan need to know of a decoder-only LM."""

    model_type: str
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool
    layer_types: tuple  # "attention" | "linear_attention", one per layer
    gated_q: bool  # q_proj emits query + output gate (2x width), as in Qwen3.5 full attention
    qk_norm: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    # Gated DeltaNet ("linear_attention") dims; 0 when the model has none
    lin_k_heads: int = 0
    lin_v_heads: int = 0
    lin_k_dim: int = 0
    lin_v_dim: int = 0
    lin_conv: int = 0


def model_shape(hf_config: dict) -> ModelShape:
    """The shape of the language model a config.json describes (its text model when nested)."""
    tc = text_config(hf_config)
    mtype = str(tc.get("model_type") or hf_config.get("model_type") or "")
    if any(tc.get(k) for k in MOE_KEYS):
        raise ValueError(f"mixture-of-experts targets ({mtype}) are not supported")
    try:
        hidden, layers = int(tc["hidden_size"]), int(tc["num_hidden_layers"])
        heads, vocab = int(tc["num_attention_heads"]), int(tc["vocab_size"])
        intermediate = int(tc["intermediate_size"])
    except KeyError as exc:
        raise ValueError(f"target config lacks {exc.args[0]!r}") from exc
    hybrid = mtype in HYBRID_TYPES
    types = tc.get("layer_types")
    if not types:
        # Same rule as transformers' Qwen3.5 config: every interval-th layer is full attention.
        interval = int(tc.get("full_attention_interval", 4)) if hybrid else 0
        types = ["linear_attention" if interval and (i + 1) % interval else "attention"
                 for i in range(layers)]
    # sliding / full attention share one parameter shape
    types = tuple("linear_attention" if t == "linear_attention" else "attention" for t in types)
    if len(types) != layers:
        raise ValueError(f"target config: {len(types)} layer_types for {layers} layers")
    attention_bias = bool(tc.get("attention_bias", False))
    return ModelShape(
        model_type=mtype, hidden=hidden, intermediate=intermediate, layers=layers, heads=heads,
        kv_heads=int(tc.get("num_key_value_heads") or heads),
        head_dim=int(tc.get("head_dim") or hidden // heads), vocab=vocab,
        # transformers reads tying from the text config; every Qwen3 family config sets it.
        tied=bool(tc.get("tie_word_embeddings", False)),
        layer_types=types, gated_q=hybrid, qk_norm=mtype in QK_NORM_TYPES,
        qkv_bias=attention_bias or mtype == "qwen2",  # Qwen2 always has q/k/v biases
        o_bias=attention_bias, mlp_bias=bool(tc.get("mlp_bias", False)),
        lin_k_heads=int(tc.get("linear_num_key_heads", 0)),
        lin_v_heads=int(tc.get("linear_num_value_heads", 0)),
        lin_k_dim=int(tc.get("linear_key_head_dim", 0)),
        lin_v_dim=int(tc.get("linear_value_head_dim", 0)),
        lin_conv=int(tc.get("linear_conv_kernel_dim", 0)),
    )


def _linear(n_in: int, n_out: int, bias: bool = False) -> int:
    return n_in * n_out + (n_out if bias else 0)


def _attention_params(s: ModelShape) -> int:
    q_width, kv_width = s.heads * s.head_dim, s.kv_heads * s.head_dim
    n = _linear(s.hidden, q_width * (2 if s.gated_q else 1), s.qkv_bias)
    n += 2 * _linear(s.hidden, kv_width, s.qkv_bias)
    n += _linear(q_width, s.hidden, s.o_bias)
    if s.qk_norm:
        n += 2 * s.head_dim
    return n


def _gdn_params(s: ModelShape) -> int:
    """Gated DeltaNet mixer, shapes as in transformers' Qwen3_5GatedDeltaNet."""
    key_dim, value_dim = s.lin_k_heads * s.lin_k_dim, s.lin_v_heads * s.lin_v_dim
    conv_dim = 2 * key_dim + value_dim
    n = _linear(s.hidden, conv_dim)  # in_proj_qkv
    n += _linear(s.hidden, value_dim)  # in_proj_z (output gate)
    n += 2 * _linear(s.hidden, s.lin_v_heads)  # in_proj_b, in_proj_a
    n += conv_dim * s.lin_conv  # depthwise conv1d, no bias
    n += 2 * s.lin_v_heads  # dt_bias, A_log
    n += s.lin_v_dim  # gated RMSNorm over one value head
    n += _linear(value_dim, s.hidden)  # out_proj
    return n


def layer_params(s: ModelShape, layer_type: str) -> int:
    mixer = _gdn_params(s) if layer_type == "linear_attention" else _attention_params(s)
    mlp = 2 * _linear(s.hidden, s.intermediate, s.mlp_bias) + _linear(s.intermediate, s.hidden,
                                                                       s.mlp_bias)
    return mixer + mlp + 2 * s.hidden  # + input_layernorm, post_attention_layernorm


def param_count(hf_config: dict) -> int:
    """Parameters of the causal LM built from this config (text model only; tied weights once)."""
    s = model_shape(hf_config)
    n = s.vocab * s.hidden  # embed_tokens
    n += sum(layer_params(s, t) for t in s.layer_types)
    n += s.hidden  # final norm
    if not s.tied:
        n += s.vocab * s.hidden  # lm_head
    return n


def drafter_param_count(cfg: Config, hf_config: dict) -> int:
    """Trainable drafter parameters: L Qwen3 layers, fc (k*H_target -> H), hidden_norm, norm."""
    t = model_shape(hf_config)
    s = drafter_shape(cfg, t)
    layers = cfg.drafter.num_layers * layer_params(s, "attention")
    return layers + num_features(cfg) * t.hidden * s.hidden + 2 * s.hidden


def drafter_matrix_param_count(cfg: Config, hf_config: dict) -> int:
    """The drafter's parameters in 2-D weight matrices (what optim.name muon gives Muon): all of
    drafter_param_count but its norm weights (no biases: drafter_shape has none)."""
    s = drafter_shape(cfg, model_shape(hf_config))
    norms = cfg.drafter.num_layers * (2 * s.hidden + 2 * s.head_dim) + 2 * s.hidden
    return drafter_param_count(cfg, hf_config) - norms


def drafter_shape(cfg: Config, t: ModelShape) -> ModelShape:
    """The drafter's decoder layers for target shape ``t``."""
    d = cfg.drafter
    # A Qwen3 decoder (q/k norms, no output gate, no biases) of the target's width unless
    # overridden; head_dim is the target's (the interchange config copies it).
    return ModelShape(
        model_type="qwen3", hidden=d.hidden_size or t.hidden,
        intermediate=d.intermediate_size or t.intermediate, layers=d.num_layers,
        heads=d.num_attention_heads or t.heads, kv_heads=d.num_key_value_heads or t.kv_heads,
        head_dim=t.head_dim, vocab=t.vocab, tied=t.tied, layer_types=("attention",) * d.num_layers,
        gated_q=False, qk_norm=True, qkv_bias=False, o_bias=False, mlp_bias=False,
    )


def num_features(cfg: Config) -> int:
    """k: target layers whose features the drafter reads (its fc takes k x target width)."""
    return len(cfg.target.layer_ids) or cfg.target.num_features
