"""A model's shape read from its config: widths, depth, heads, vocabulary, the kind of each layer
(attention, Gated DeltaNet or multi-head latent attention; dense MLP or mixture of experts), and
the parameters that follow from them, by group. Nothing is loaded.

The one place that knows which keys of an HF config.json hold what, and that multimodal configs
nest the language model under ``text_config``. Keys are read by what they mean rather than by
model type where the families agree (``num_experts`` / ``num_local_experts`` / ``n_routed_experts``
are one count), so a config of a family not listed here but with the same keys is read the same.
The drafter's shape is derived from the target's and the drafter section of config.yaml, as
drafter.py builds it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dflash_core.config import Config
from dflash_core.families.registry import head_params

HYBRID_TYPES = ("qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text")  # Gated DeltaNet +
# gated full attention layers
QK_NORM_TYPES = ("qwen3", "qwen3_5", "qwen3_5_text", "qwen3_moe", "qwen3_5_moe", "qwen3_5_moe_text",
                 "gemma3", "gemma3_text")
FOUR_NORM_TYPES = ("gemma3", "gemma3_text")  # pre / post feed-forward norms besides the usual two
EXPERT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")
TOP_K_KEYS = ("num_experts_per_tok", "experts_per_token", "moe_topk")
# gpt-oss: a biased router and biased experts, and one attention-sink logit per head
BIASED_EXPERT_TYPES = ("gpt_oss",)
NO_O_BIAS_TYPES = ("glm4_moe",)  # q/k/v take attention_bias, o_proj never has one
GROUPS = ("embeddings", "lm_head", "attention", "linear_attention", "mlp", "shared_experts",
          "experts", "router", "other", "vision")  # other: norms, convolutions, sinks


def text_config(config: Any) -> Any:
    """The language-model part of a config, a config.json dict or a transformers config object:
    multimodal configs nest it under ``text_config``."""
    if isinstance(config, dict):
        tc = config.get("text_config")
        return tc if isinstance(tc, dict) and tc else config
    return getattr(config, "text_config", None) or config


def _get(config: Any, *keys: str, default: Any = None) -> Any:
    """The first of ``keys`` set (not None) in a config dict or object."""
    for key in keys:
        value = config.get(key) if isinstance(config, dict) else getattr(config, key, None)
        if value is not None:
            return value
    return default


def drafter_intermediate(tc: Any) -> int:
    """The MLP width a drafter of this target gets by default (``drafter.intermediate_size: 0``),
    for a text config dict or object. A dense target's own width. A mixture of experts keeps a
    dense ``intermediate_size`` beside ``moe_intermediate_size`` for its dense layers (Qwen3-MoE:
    6144, DeepSeek-V3: 18432, GLM-4.5: 12288): that one. Otherwise (Qwen3.5-MoE has none; gpt-oss's
    ``intermediate_size`` is one expert's) the width a token passes through: experts per token x
    expert width + shared experts' width, which equals the dense width where both exist
    (Qwen3-30B-A3B: 8 x 768 = 6144; DeepSeek-V3: 8 x 2048 + 2048 = 18432)."""
    experts = int(_get(tc, *EXPERT_KEYS, default=0) or 0)
    moe_width = _get(tc, "moe_intermediate_size")
    dense = _get(tc, "intermediate_size")
    if not experts or (moe_width and dense):
        if dense is None:
            raise ValueError("target config lacks 'intermediate_size'")
        return int(dense)
    expert_width = int(moe_width or dense or 0)
    top_k = int(_get(tc, *TOP_K_KEYS, default=1) or 1)
    return top_k * expert_width + _shared_width(tc, expert_width)


def _shared_width(tc: Any, expert_width: int) -> int:
    """Width of the always-on shared expert(s): Qwen's one shared expert of its own width,
    DeepSeek / GLM's n_shared_experts of the expert width."""
    qwen = _get(tc, "shared_expert_intermediate_size")
    if qwen is not None:
        return int(qwen)
    return int(_get(tc, "n_shared_experts", default=0) or 0) * expert_width


@dataclass(frozen=True)
class ModelShape:
    """What the parameter count and the memory plan need to know of a decoder-only LM."""

    model_type: str
    hidden: int
    intermediate: int  # width of the dense MLP layers (0 when every layer is a mixture of experts)
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
    # Mixture of experts; 0 / () when the model has none
    mlp_types: tuple = ()  # "dense" | "moe", one per layer (empty = all dense)
    experts: int = 0  # routed experts per MoE layer
    experts_per_tok: int = 0
    expert_intermediate: int = 0
    shared_intermediate: int = 0  # the shared expert(s), all together
    shared_gate: bool = False  # a 1 x H sigmoid gate on the shared expert (Qwen2/3.5-MoE)
    expert_bias: bool = False  # router and expert biases (gpt-oss)
    attn_sinks: bool = False  # one sink logit per head (gpt-oss)
    # Multi-head latent attention (DeepSeek-V3, Kimi-K2); 0 when the model has none
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_nope_dim: int = 0
    qk_rope_dim: int = 0
    v_head_dim: int = 0
    norms_per_layer: int = 2
    drafter_intermediate: int = 0  # drafter_intermediate(): the drafter's default MLP width

    @property
    def mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def moe_layers(self) -> int:
        return sum(t == "moe" for t in self.mlp_types)

    def mlp_type(self, i: int) -> str:
        return self.mlp_types[i] if self.mlp_types else "dense"


def _mlp_types(tc: dict, layers: int, experts: int) -> tuple:
    """Which layers route to experts, by the rules of transformers' modeling files: DeepSeek /
    GLM keep their first ``first_k_dense_replace`` layers dense; Qwen2/3-MoE name dense layers in
    ``mlp_only_layers`` and route every ``decoder_sparse_step``-th layer."""
    if not experts:
        return ()
    first = int(tc.get("first_k_dense_replace") or 0)
    only = set(tc.get("mlp_only_layers") or ())
    step = int(tc.get("decoder_sparse_step") or 1)
    return tuple("moe" if i >= first and i not in only and (i + 1) % step == 0 else "dense"
                 for i in range(layers))


def _tied(hf_config: dict, tc: dict, mtype: str) -> bool:
    """transformers ties the lm_head to the embeddings by the config of the model it builds: the
    text config for a causal LM (every Qwen3 family config sets it), the top level for a
    multimodal wrapper loaded whole (Gemma 3's, which ties by default)."""
    default = mtype in FOUR_NORM_TYPES
    if tc is not hf_config and loads_whole_multimodal(str(hf_config.get("model_type"))):
        return bool(hf_config.get("tie_word_embeddings", default))
    return bool(tc.get("tie_word_embeddings", default))


def model_shape(hf_config: dict) -> ModelShape:
    """The shape of the language model a config.json describes (its text model when nested)."""
    tc = text_config(hf_config)
    mtype = str(tc.get("model_type") or hf_config.get("model_type") or "")
    try:
        hidden, layers = int(tc["hidden_size"]), int(tc["num_hidden_layers"])
        heads, vocab = int(tc["num_attention_heads"]), int(tc["vocab_size"])
        drafter_width = drafter_intermediate(tc)
    except KeyError as exc:
        raise ValueError(f"target config lacks {exc.args[0]!r}") from exc
    experts = int(_get(tc, *EXPERT_KEYS, default=0) or 0)
    expert_width = int(tc.get("moe_intermediate_size") or tc.get("intermediate_size") or 0) \
        if experts else 0
    # A MoE config's intermediate_size is its dense layers' width where it also names an expert
    # width; gpt-oss / Mixtral name only one, the experts'.
    dense_width = int(tc.get("intermediate_size") or 0) if (
        not experts or tc.get("moe_intermediate_size")) else 0
    if not experts and "intermediate_size" not in tc:
        raise ValueError("target config lacks 'intermediate_size'")
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
    kv_lora = int(tc.get("kv_lora_rank") or 0)
    rope_dim = int(tc.get("qk_rope_head_dim") or 0)
    # transformers' DeepSeek-V3 config takes head_dim for the rope part of a head where the file
    # names none (the releases do not): the drafter copies that head_dim (build_drafter_config
    # reads the config object). MLA's own widths are the qk_* / v_head_dim keys.
    head_dim = int(tc.get("head_dim") or (kv_lora and rope_dim) or hidden // heads)
    return ModelShape(
        model_type=mtype, hidden=hidden, intermediate=dense_width, layers=layers, heads=heads,
        kv_heads=int(tc.get("num_key_value_heads") or heads), head_dim=head_dim, vocab=vocab,
        tied=_tied(hf_config, tc, mtype),
        layer_types=types, gated_q=hybrid,
        qk_norm=mtype in QK_NORM_TYPES or bool(tc.get("use_qk_norm", False)),
        qkv_bias=attention_bias or mtype == "qwen2",  # Qwen2 always has q/k/v biases
        o_bias=attention_bias and mtype not in NO_O_BIAS_TYPES,
        mlp_bias=bool(tc.get("mlp_bias", False)),
        lin_k_heads=int(tc.get("linear_num_key_heads", 0)),
        lin_v_heads=int(tc.get("linear_num_value_heads", 0)),
        lin_k_dim=int(tc.get("linear_key_head_dim", 0)),
        lin_v_dim=int(tc.get("linear_value_head_dim", 0)),
        lin_conv=int(tc.get("linear_conv_kernel_dim", 0)),
        mlp_types=_mlp_types(tc, layers, experts), experts=experts,
        experts_per_tok=int(_get(tc, *TOP_K_KEYS, default=1) or 1) if experts else 0,
        expert_intermediate=expert_width,
        shared_intermediate=_shared_width(tc, expert_width) if experts else 0,
        shared_gate=experts > 0 and tc.get("shared_expert_intermediate_size") is not None,
        expert_bias=mtype in BIASED_EXPERT_TYPES, attn_sinks=mtype in BIASED_EXPERT_TYPES,
        q_lora_rank=int(tc.get("q_lora_rank") or 0) if kv_lora else 0, kv_lora_rank=kv_lora,
        qk_nope_dim=int(tc.get("qk_nope_head_dim") or 0) if kv_lora else 0,
        qk_rope_dim=rope_dim if kv_lora else 0,
        v_head_dim=int(tc.get("v_head_dim") or 0) if kv_lora else 0,
        norms_per_layer=4 if mtype in FOUR_NORM_TYPES else 2,
        drafter_intermediate=drafter_width,
    )


# --------------------------------------------------------------------------------------------
# Parameters, by group
# --------------------------------------------------------------------------------------------

class Ledger:
    """Parameters by group, with every weight matrix kept as (rows, cols, copies): a block-wise
    quantized checkpoint stores one scale per block of a matrix, so its bytes depend on them."""

    def __init__(self) -> None:
        self.matrices: dict[str, list[tuple[int, int, int]]] = {g: [] for g in GROUPS}
        self.vectors: dict[str, int] = dict.fromkeys(GROUPS, 0)

    def linear(self, group: str, n_in: int, n_out: int, bias: bool = False,
               copies: int = 1) -> None:
        self.matrices[group].append((n_out, n_in, copies))
        if bias:
            self.vectors[group] += n_out * copies

    def vector(self, n: int, group: str = "other") -> None:
        self.vectors[group] += n

    def group(self, name: str) -> int:
        return sum(r * c * k for r, c, k in self.matrices[name]) + self.vectors[name]

    def groups(self) -> dict[str, int]:
        return {g: self.group(g) for g in GROUPS}

    @property
    def total(self) -> int:
        return sum(self.groups().values())

    def scale(self, times: int) -> None:
        """Every entry ``times`` over (layers of one kind)."""
        for g in GROUPS:
            self.matrices[g] = [(r, c, k * times) for r, c, k in self.matrices[g]]
            self.vectors[g] *= times

    def add(self, other: "Ledger") -> None:
        for g in GROUPS:
            self.matrices[g] += other.matrices[g]
            self.vectors[g] += other.vectors[g]


def _attention(s: ModelShape, led: Ledger) -> None:
    if s.mla:
        _mla(s, led)
        return
    q_width, kv_width = s.heads * s.head_dim, s.kv_heads * s.head_dim
    led.linear("attention", s.hidden, q_width * (2 if s.gated_q else 1), s.qkv_bias)
    led.linear("attention", s.hidden, kv_width, s.qkv_bias, copies=2)
    led.linear("attention", q_width, s.hidden, s.o_bias)
    if s.qk_norm:
        led.vector(2 * s.head_dim)
    if s.attn_sinks:
        led.vector(s.heads)


def _mla(s: ModelShape, led: Ledger) -> None:
    """Multi-head latent attention, shapes as in transformers' DeepseekV3Attention: queries
    through a low-rank q_a / q_b pair (or one q_proj), keys and values through a shared latent of
    kv_lora_rank plus one rope key for all heads."""
    qk_head = s.qk_nope_dim + s.qk_rope_dim
    bias = s.qkv_bias
    if s.q_lora_rank:
        led.linear("attention", s.hidden, s.q_lora_rank, bias)
        led.vector(s.q_lora_rank)  # q_a_layernorm
        led.linear("attention", s.q_lora_rank, s.heads * qk_head)
    else:
        led.linear("attention", s.hidden, s.heads * qk_head)
    led.linear("attention", s.hidden, s.kv_lora_rank + s.qk_rope_dim, bias)  # kv_a_proj_with_mqa
    led.vector(s.kv_lora_rank)  # kv_a_layernorm
    led.linear("attention", s.kv_lora_rank, s.heads * (s.qk_nope_dim + s.v_head_dim))
    led.linear("attention", s.heads * s.v_head_dim, s.hidden, s.o_bias)


def _gdn(s: ModelShape, led: Ledger) -> None:
    """Gated DeltaNet mixer, shapes as in transformers' Qwen3_5GatedDeltaNet."""
    key_dim, value_dim = s.lin_k_heads * s.lin_k_dim, s.lin_v_heads * s.lin_v_dim
    conv_dim = 2 * key_dim + value_dim
    led.linear("linear_attention", s.hidden, conv_dim)  # in_proj_qkv
    led.linear("linear_attention", s.hidden, value_dim)  # in_proj_z (output gate)
    led.linear("linear_attention", s.hidden, s.lin_v_heads, copies=2)  # in_proj_b, in_proj_a
    led.vector(conv_dim * s.lin_conv)  # depthwise conv1d, no bias
    led.vector(2 * s.lin_v_heads)  # dt_bias, A_log
    led.vector(s.lin_v_dim)  # gated RMSNorm over one value head
    led.linear("linear_attention", value_dim, s.hidden)  # out_proj


def _mlp(s: ModelShape, led: Ledger, group: str, width: int) -> None:
    led.linear(group, s.hidden, width, s.mlp_bias, copies=2)  # gate_proj, up_proj
    led.linear(group, width, s.hidden, s.mlp_bias)  # down_proj


def _moe(s: ModelShape, led: Ledger) -> None:
    """Router, routed experts (fused gate_up / down tensors of all experts) and shared experts."""
    led.linear("router", s.hidden, s.experts, s.expert_bias)
    E, I = s.experts, s.expert_intermediate
    led.linear("experts", s.hidden, 2 * I, copies=E)  # gate_up_proj
    led.linear("experts", I, s.hidden, copies=E)  # down_proj
    if s.expert_bias:
        led.vector(E * (2 * I + s.hidden), "experts")
    if s.shared_intermediate:
        _mlp(s, led, "shared_experts", s.shared_intermediate)
        if s.shared_gate:
            led.linear("shared_experts", s.hidden, 1)


def layer_ledger(s: ModelShape, layer_type: str, mlp_type: str = "dense") -> Ledger:
    led = Ledger()
    (_gdn if layer_type == "linear_attention" else _attention)(s, led)
    if mlp_type == "moe":
        _moe(s, led)
    else:
        _mlp(s, led, "mlp", s.intermediate)
    led.vector(s.norms_per_layer * s.hidden)  # input / post-attention (+ Gemma's two) norms
    return led


def layer_params(s: ModelShape, layer_type: str, mlp_type: str = "dense") -> int:
    return layer_ledger(s, layer_type, mlp_type).total


def param_ledger(hf_config: dict) -> Ledger:
    """Parameters of the causal LM transformers builds from this config, by group (tied weights
    once): the text model, and the vision tower where the causal-LM class is the whole
    multimodal model (Gemma 3)."""
    s = model_shape(hf_config)
    led = Ledger()
    led.linear("embeddings", s.hidden, s.vocab)
    kinds: dict[tuple[str, str], int] = {}
    for i, t in enumerate(s.layer_types):
        kinds[(t, s.mlp_type(i))] = kinds.get((t, s.mlp_type(i)), 0) + 1
    for (t, m), n in kinds.items():
        one = layer_ledger(s, t, m)
        one.scale(n)
        led.add(one)
    led.vector(s.hidden)  # final norm
    if not s.tied:
        led.linear("lm_head", s.hidden, s.vocab)
    led.vector(vision_params(hf_config), "vision")
    return led


def param_count(hf_config: dict) -> int:
    """Parameters of the causal LM built from this config (text model, and a vision tower
    transformers loads with it; tied weights once)."""
    return param_ledger(hf_config).total


def loads_whole_multimodal(model_type: str) -> bool:
    """transformers' causal-LM class for this model type is the whole image-text model (Gemma 3),
    not its language model alone (Qwen3.5 has a text-only one): the vision tower loads too."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type) or ""
    return name.endswith("ForConditionalGeneration")


def vision_params(hf_config: dict) -> int:
    """A ViT vision tower (SigLIP, as Gemma 3 has) and its projector into the text width, from
    ``vision_config``; 0 when the config has none or transformers would not load it."""
    vc = hf_config.get("vision_config") if isinstance(hf_config, dict) else None
    if not isinstance(vc, dict) or not loads_whole_multimodal(str(hf_config.get("model_type"))):
        return 0
    H, I = int(vc.get("hidden_size", 1152)), int(vc.get("intermediate_size", 4304))
    L = int(vc.get("num_hidden_layers", 27))
    patch, image = int(vc.get("patch_size", 14)), int(vc.get("image_size", 896))
    layer = 4 * (H * H + H) + 2 * H * I + I + H + 4 * H  # q, k, v, out; fc1, fc2; 2 layer norms
    n = L * layer + 3 * patch * patch * H + H + (image // patch) ** 2 * H + 2 * H
    if vc.get("vision_use_head", True):
        n += 4 * (H * H + H) + H + 2 * H * I + I + H + 2 * H  # attention-pooling head
    text_hidden = int(text_config(hf_config).get("hidden_size", 0))
    return n + H * text_hidden + H  # projector and its norm


# --------------------------------------------------------------------------------------------
# The drafter
# --------------------------------------------------------------------------------------------

def drafter_param_count(cfg: Config, hf_config: dict) -> int:
    """Trainable drafter parameters: L Qwen3 layers, fc (k*H_target -> H), hidden_norm, norm;
    with drafter.objective dspark also its Markov and confidence heads."""
    t = model_shape(hf_config)
    s = drafter_shape(cfg, t)
    layers = cfg.drafter.num_layers * layer_params(s, "attention")
    return (layers + num_features(cfg) * t.hidden * s.hidden + 2 * s.hidden
            + head_params(cfg, s.hidden, t.vocab))


def drafter_matrix_param_count(cfg: Config, hf_config: dict) -> int:
    """The drafter's parameters in 2-D weight matrices (what optim.name muon gives Muon): all of
    drafter_param_count but its norm weights (no biases: drafter_shape has none) and DSpark's
    heads (a lookup table, a map onto the vocabulary and one row: AdamW's,
    training/optimizers.py)."""
    t = model_shape(hf_config)
    s = drafter_shape(cfg, t)
    norms = cfg.drafter.num_layers * (2 * s.hidden + 2 * s.head_dim) + 2 * s.hidden
    heads = head_params(cfg, s.hidden, t.vocab)
    return drafter_param_count(cfg, hf_config) - norms - heads


def drafter_shape(cfg: Config, t: ModelShape) -> ModelShape:
    """The drafter's decoder layers for target shape ``t``."""
    d = cfg.drafter
    # A Qwen3 decoder (q/k norms, no output gate, no biases) of the target's width unless
    # overridden; head_dim is the target's (the interchange config copies it).
    return ModelShape(
        model_type="qwen3", hidden=d.hidden_size or t.hidden,
        intermediate=d.intermediate_size or t.drafter_intermediate, layers=d.num_layers,
        heads=d.num_attention_heads or t.heads, kv_heads=d.num_key_value_heads or t.kv_heads,
        head_dim=t.head_dim, vocab=t.vocab, tied=t.tied, layer_types=("attention",) * d.num_layers,
        gated_q=False, qk_norm=True, qkv_bias=False, o_bias=False, mlp_bias=False,
    )


def num_features(cfg: Config) -> int:
    """k: target layers whose features the drafter reads (its fc takes k x target width)."""
    return len(cfg.target.layer_ids) or cfg.target.num_features
