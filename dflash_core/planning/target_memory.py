"""The memory plan's target terms: what a target GPU holds for one forward, from its config.

Apart from memory.py, which adds them to the drafter's (drafter_memory.py) per device: the whole
target's weights, one inference forward's residual stream and largest layer transient (dense,
mixture-of-experts, attention, multi-head latent attention, Gated DeltaNet), the padding mask,
and the features it sends and queues; with the measurements their constants come from.
"""

from __future__ import annotations

import math

from dflash_core.config import Config
from dflash_core.families.registry import family_of, feature_vectors
from dflash_core.models.target.config import default_layer_ids
from dflash_core.models.target.shape import ModelShape, model_shape, num_features
from dflash_core.planning.weight_bytes import (
    FP32_BYTES, dtype_bytes, fp8_dequantized_weight_bytes, target_weight_parts,
)


# Target forward (inference_mode: nothing is saved for backward, only transients are live).
# Checked on an H200 (torch 2.11, transformers 5.17, fla 0.6, no causal_conv1d package) with a
# Qwen3.6-27B-shaped stack on 21 x 3072 padded tokens: the peak over the weights was 12.6 GiB in a
# Gated DeltaNet layer and 13.2 GiB in a full-attention layer; the terms below give 12.2 and 13.0.
RESIDUAL_LIVE = 3  # residual, the layer's normed input / output, and the embeddings the decoder
# keeps referenced for the whole forward: each tokens x H
MLP_LIVE = 3  # gate_proj out, up_proj out, act(gate) * up; down_proj output reuses a freed one
GDN_CHUNK = 64  # flash-linear-attention chunk size: one K x V state per chunk per value head
# A mixture-of-experts layer (transformers' grouped_mm experts, integrations/moe.py) works on
# tokens x experts_per_tok (token, expert) pairs. Per pair, the largest of: the gathered input (H),
# gate_up out (2I) and the gate's I-wide temporaries; then the input, the gated I and the down
# output (2H + I); at the end the input, the down output, the weighted and the reordered copies
# (4H). The gate's temporaries: act(gate) and the product (2) for SwiGLU; gpt-oss's clamped GLU
# keeps the clamped gate and up, the GLU, up + 1 and the product (5). The router adds its logits
# (dtype) and a float32 softmax and top-k copy per routed expert.
MOE_GATE_LIVE = 2
CLAMPED_GLU_TYPES = {"gpt_oss": 5}
MOE_ROUTER_BYTES = 2 * FP32_BYTES  # + the dtype's logits


# --------------------------------------------------------------------------------------------
# The target's layer choice and dtype
# --------------------------------------------------------------------------------------------

def _last_layer(cfg: Config, s: ModelShape) -> int:
    if family_of(cfg).last_hidden:
        return s.layers - 1  # the post-norm last hidden state: every layer runs
    if cfg.target.layer_ids:
        return max(cfg.target.layer_ids)
    try:
        return max(default_layer_ids(s.layers, cfg.target.num_features))
    except ValueError:  # too shallow for the default: preflight refuses it (target_checks.py)
        return s.layers - 1


def target_dtype(cfg: Config, on_cuda: bool) -> str:
    return cfg.target.dtype if on_cuda else "float32"  # engine.py runs CPU targets in float32


# --------------------------------------------------------------------------------------------
# The target's components
# --------------------------------------------------------------------------------------------

def _target_layer_transient(s: ModelShape, tokens: int, b: int, run_types: set[str],
                            attn_impl: str, max_length: int, masked: bool = True) -> int:
    """Largest per-layer transient of an inference forward, in bytes."""
    peaks = [MLP_LIVE * tokens * s.intermediate * b] if "dense" in run_types else []
    if "moe" in run_types:
        H, I = s.hidden, s.expert_intermediate
        gate = CLAMPED_GLU_TYPES.get(s.model_type, MOE_GATE_LIVE)
        pair = max(H + (2 + gate) * I, 2 * H + I, 4 * H)
        moe = tokens * s.experts_per_tok * pair * b + tokens * s.experts * (b + MOE_ROUTER_BYTES)
        if s.shared_intermediate:  # runs beside the routed output (tokens x H)
            moe += tokens * (MLP_LIVE * s.shared_intermediate + H) * b
        peaks.append(moe)
    if "attention" in run_types and s.mla:
        peaks.append(_mla_transient(s, tokens, b, attn_impl, max_length))
    elif "attention" in run_types:
        q = s.heads * s.head_dim
        # q_proj output (query+gate stay referenced to the end), normed and roped q (2), k/v
        # expanded to all heads (2: eager always, SDPA with a padding mask; without one it runs
        # grouped-query attention as it is), attention out, gated out, o_proj, and the float32
        # upcasts of q_norm and the RoPE split / concat temporaries (6).
        expanded = 2 * q if attn_impl == "eager" or (attn_impl == "sdpa" and masked) else 0
        per_token = q * (2 if s.gated_q else 1) + 2 * q + expanded + q + (q if s.gated_q else 0)
        per_token += s.hidden + 6 * q
        attn = tokens * per_token * b
        attn += _eager_scores(s, tokens, b, attn_impl, max_length)
        peaks.append(attn)
    if "linear_attention" in run_types:
        key_dim, value_dim = s.lin_k_heads * s.lin_k_dim, s.lin_v_heads * s.lin_v_dim
        conv_dim = 2 * key_dim + value_dim
        # Throughout: the padding-masked input copy, conv output (q, k, v views) and z.
        # Kernel phase (flash-linear-attention chunked delta rule): contiguous q / k / v copies,
        # l2-normalised q and k, w, u, new v, output, two float32 intra-chunk matrices (A and its
        # inverse), and one K x V state per chunk per value head. Gated-norm phase: core output
        # plus three float32 temporaries of value_dim (upcast input, upcast gate, product).
        common = tokens * (s.hidden + conv_dim + value_dim) * b
        kernel = (tokens * (conv_dim + 2 * key_dim + s.lin_v_heads * s.lin_k_dim
                            + 3 * value_dim) * b
                  + 2 * tokens * s.lin_v_heads * GDN_CHUNK * FP32_BYTES
                  + math.ceil(tokens / GDN_CHUNK) * s.lin_v_heads * s.lin_k_dim * s.lin_v_dim * b)
        norm = tokens * value_dim * (b + 3 * FP32_BYTES)
        peaks.append(common + max(kernel, norm))
    return max(peaks)


def _eager_scores(s: ModelShape, tokens: int, b: int, attn_impl: str, max_length: int) -> int:
    """Eager attention materialises heads x S x S scores per sequence (dtype) and a float32
    softmax; gpt-oss's (with its sink column) keeps three dtype copies instead: the scores, the
    logits with the sink and their max-subtracted copy."""
    if attn_impl != "eager":
        return 0
    per_score = max(b + FP32_BYTES, 3 * b) if s.attn_sinks else b + FP32_BYTES
    return tokens * max_length * s.heads * per_score


def _mla_transient(s: ModelShape, tokens: int, b: int, attn_impl: str, max_length: int) -> int:
    """A multi-head latent attention layer (transformers' DeepseekV3Attention) expands its latent
    to full keys and values for every head, as its cache does: q_a / kv_a outputs, q (q_b out,
    its rope split and the concatenated query), kv_b out (k_nope and v of every head), the
    concatenated key with the rope key expanded to all heads, attention out, o_proj out, and the
    float32 RoPE temporaries of the rope parts."""
    qk = s.heads * (s.qk_nope_dim + s.qk_rope_dim)
    kv_b = s.heads * (s.qk_nope_dim + s.v_head_dim)
    per_token = (s.q_lora_rank + s.kv_lora_rank + s.qk_rope_dim + 3 * qk + kv_b + qk
                 + s.heads * s.v_head_dim + s.hidden + 6 * s.heads * s.qk_rope_dim)
    return tokens * per_token * b + _eager_scores(s, tokens, b, attn_impl, max_length)


def _padding_mask(cfg: Config) -> int:
    """SDPA's padding mask: one bool per (query, key) pair of each row, n x S^2 <= T x S for rows
    of S tokens. A batch of one row has no padding and transformers then runs SDPA causal
    without a mask (masking_utils skips it), so only batches of 2+ rows count, whose rows are at
    most T / 2 long: at 128k tokens a sample, 8 GiB for two rows of 64k, not 16 for one; none
    with data.max_seqs_per_batch 1."""
    if cfg.target.attn_implementation == "flash_attention_2" or cfg.data.max_seqs_per_batch < 2:
        return 0
    t = cfg.data.token_budget
    return t * min(cfg.data.max_length, t // 2)


def target_components(cfg: Config, s: ModelShape, hf_config: dict, on_cuda: bool,
                      queued: int, quantized: bool) -> dict[str, int]:
    t, b = cfg.data.token_budget, dtype_bytes(target_dtype(cfg, on_cuda))
    last = _last_layer(cfg, s) + 1
    run_types = set(s.layer_types[:last]) | {s.mlp_type(i) for i in range(last)}
    features = t * feature_vectors(cfg, num_features(cfg)) * s.hidden * b
    weights = target_weight_parts(hf_config, target_dtype(cfg, on_cuda), quantized)
    return {
        **(group_share(cfg, s, weights, features, on_cuda) if cfg.target.gpus_per_copy > 1
           else weights),
        # FP8 weights kept FP8: one of them dequantized while its layer runs
        "FP8 weight dequantized": fp8_dequantized_weight_bytes(
            hf_config, target_dtype(cfg, on_cuda), experts=cfg.target.gpus_per_copy > 1)
        if quantized else 0,
        "residual stream": RESIDUAL_LIVE * t * s.hidden * b,
        "layer transient": _target_layer_transient(
            s, t, b, run_types, cfg.target.attn_implementation, cfg.data.max_length,
            masked=cfg.data.max_seqs_per_batch > 1),
        "attention mask": _padding_mask(cfg),
        "features": features,
        "hs queue": queued * features,
    }


def group_share(cfg: Config, s: ModelShape, weights: dict[str, int], features: int,
                on_cuda: bool) -> dict[str, int]:
    """One rank's share of a target copy over target.gpus_per_copy GPUs (target_group/split.py),
    in place of the whole copy's weights. Sharded (FSDP): every weight over k, plus one layer
    gathered whole while it runs (its dense part; experts under expert parallel stay split).
    Shared (tensor parallel): the weights over k (the plan's rule: embeddings, norms and routers
    are small beside the split matrices), experts over k under expert parallel, else whole. Each
    rank is a process of its own: its own CUDA context, and its hand-off ring of features sent
    and not yet acknowledged."""
    from dflash_core.planning.card_budget import CUDA_CONTEXT
    from dflash_core.target_group.group import RING
    from dflash_core.target_group.split import SHARDED

    k, moe = cfg.target.gpus_per_copy, s.experts > 0
    split_experts = moe and cfg.target.expert_parallel
    dense, experts = weights["weights"], weights["experts"]
    out = {"weights": math.ceil(dense / k),
           "experts": math.ceil(experts / k) if split_experts or cfg.target.parallel == SHARDED
           else experts}
    if cfg.target.parallel == SHARDED:
        out["gathered layer"] = math.ceil(dense / max(1, s.layers)) + (
            0 if split_experts else math.ceil(experts / max(1, s.layers)))
    out["hand-off ring"] = RING * features
    if on_cuda:
        out["rank's CUDA context"] = CUDA_CONTEXT
    return out


def target_tensors(cfg: Config, target_hf_config: dict, on_cuda: bool = True,
                   quantized: bool | None = None) -> dict[str, int]:
    """A target device's planned tensors with one batch in flight and none queued, without the
    CUDA margins: what a lone forward holds (bench/target/moe_target.py measures against it)."""
    kept = on_cuda if quantized is None else quantized
    comps = target_components(cfg, model_shape(target_hf_config), target_hf_config, on_cuda, 0,
                              kept)
    return {k: v for k, v in comps.items() if v}
