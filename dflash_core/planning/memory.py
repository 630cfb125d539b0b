"""Preflight memory plan: each device's peak, estimated from config dicts alone (no weights loaded).

The plan runs before tens of GB of weights are loaded, so a layout that cannot fit is refused with
a message naming the config key to change (the plan picks the key; memory_report.py words the
table and the message). Estimates are deliberately simple: each component is a
product of shapes and a small documented constant. They aim to be a little pessimistic, never a
large underestimate; "plan vs actual" once running shows how close they are.

Engine facts this plan models (they are decisions of target.py / drafter.py / engine.py):
- a target GPU holds the WHOLE target (layers after the last chosen one included) in
  ``target.dtype``, runs one ``data.token_budget``-token batch under inference_mode, stops after the
  last chosen layer and never computes lm_head logits; a mixture of experts holds every expert
  (its routed experts and router are their own row, "experts"), and a quantized checkpoint holds
  the bytes it is stored in where transformers runs it as it is (FP8 block-wise on CUDA, MXFP4
  with triton kernels), else the bytes of the dtype it is dequantized to;
- a drafter GPU holds the drafter in fp32 with its optimizer (optim.name: AdamW's two moments
  per parameter, or Muon's one momentum per matrix entry) and the frozen borrowed embed_tokens /
  lm_head in the target dtype, receives a whole target batch of features, and runs forward +
  backward over groups of sequences of at most ``drafter.micro_block_tokens`` block tokens
  (trainer.py), under bf16 autocast on CUDA;
- queued feature batches stay on the target GPU that made them until a drafter takes them;
- drafter.objective dspark: the target runs every layer and its final norm and sends its
  post-norm last hidden state with the k layer features (k+1 H-vectors per token in the features,
  the hs queue and the drafter's copy); the drafter adds the Markov and confidence heads (AdamW
  on float32 masters, under Muon too) and DSpark's loss chunk;
- on CPU both roles run in float32.

Sizes are bytes (units.GiB = 2**30).
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from typing import Any

from dflash_core.config import Config, key_value, set_key_value
from dflash_core.levers import (
    FIT_LEVERS, HS_QUEUE, LOSS_CHUNK, MICRO_BLOCK_TOKENS, NUM_ANCHORS, NUM_LAYERS, TOKEN_BUDGET,
    Lever,
)
from dflash_core.models import drafter_objective
from dflash_core.models.model_shape import (
    ModelShape, drafter_matrix_param_count, drafter_param_count, drafter_shape, model_shape,
    num_features,
)
from dflash_core.models.objective import sequences_per_group
from dflash_core.planning.weight_bytes import (
    FP32_BYTES, dtype_bytes, full_logits_bytes, target_weight_parts,
)
from dflash_core.units import GiB


# What a GPU holds beyond the tensors, counted once per CUDA device (not on CPU), so that "fits"
# means planned tensors + this margin <= the memory the process may use. Measured with
# bench/pipeline.py on two H200s capped at 95 GiB (torch 2.11, expandable segments, the 27B
# shape of config.yaml, 18 steps; bench/BENCHMARKS.md, "The shipped config on a 96 GB card"):
# - NVML used minus torch reserved (CUDA context, cuBLAS / Triton modules, driver pools):
#   1.3 GiB on the target GPU, 1.8 GiB on the drafter GPU;
# - torch reserved minus torch's peak allocated (the allocator's own slack): 0.9 GiB (1.1%) on
#   the target, 2.7 GiB (3.1%) on the drafter. Without expandable segments the target's slack
#   was 12.9 GiB (16%), which is why the engine turns them on (allocator.py).
CUDA_CONTEXT = 2 * GiB
ALLOCATOR_RESERVE = 0.04  # of the planned tensors
MARGIN_NAMES = ("cuda context", "allocator reserve")


def cuda_margin(tensors: int) -> dict[str, int]:
    """The margin components for a GPU whose planned tensors total ``tensors`` bytes."""
    return {"cuda context": CUDA_CONTEXT, "allocator reserve": math.ceil(ALLOCATOR_RESERVE * tensors)}

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
# Drafter training (autograd saves activations; optimizer states are fp32).
ADAM_BYTES_PER_PARAM = 16  # fp32 master weight 4 + fp32 grad 4 + AdamW exp_avg 4 + exp_avg_sq 4
# optim.name muon: a matrix entry has fp32 weight 4 + grad 4 + Muon's momentum 4; the norms stay on
# AdamW (16). Muon's Newton-Schulz work (a bf16 copy of one matrix and two square products, about
# 0.7 GiB for a 27B-shaped MLP matrix) lives only inside the optimizer step, after backward has
# freed the activations, so it never meets the peak counted here.
MUON_BYTES_PER_PARAM = 12
AUTOCAST_COPY_BYTES = 2  # autocast caches a bf16 copy of every fp32 weight for fwd + bwd
# Tensors autograd saves, in 2-byte units (a float32 tensor counts 2), measured on drafter.py under
# bf16 autocast with saved_tensors_hooks, attention saving q, k, v, out as flex attention does.
# The residual stream is float32 (block embeddings enter as float32), so norms save float32
# inputs, linears save bf16 casts, and RoPE makes float32 q / k.
# Per block token per layer: 9 x H (2 norms' inputs, residual, casts), 7 x heads*head_dim (q path,
# attention out), 11 x kv_heads*head_dim (block k / v path and the [context; block] concat),
# 4 x intermediate (gate, up, act(gate), product). The fused RMSNorm (drafter.py) saves only its
# float32 input; transformers' eager one also kept its normalised output (float32 in the residual
# norms: 2 x H each; the bf16 rounding in q_norm / k_norm: 1 x each) -- 13 / 8 / 12 before, and
# the drafter's peak on an H200 fell by the difference (bench/BENCHMARKS.md).
DRAFTER_SAVED_H, DRAFTER_SAVED_Q, DRAFTER_SAVED_KV, DRAFTER_SAVED_I = 9, 7, 11, 4
# Per context token, once: the features cast to float32 (2 x k*H, transient) and the bf16 copy fc
# saves (k*H), plus fc out and hidden_norm's float32 input (5 x H). Per layer: the context cast for
# k_proj / v_proj (2 x H) and the context k / v path (11 x kv_heads*head_dim).
CONTEXT_ONCE_KH, CONTEXT_ONCE_H, CONTEXT_LAYER_H, CONTEXT_LAYER_KV = 3, 5, 2, 11
UNIT_BYTES = 2
# Chunked cross-entropy, per logit of one chunk (each chunk is recomputed in backward, so one is
# live): bf16 logits 2 + float32 upcast 4 + bf16 grad 2; the log-softmax and float32 grad are not
# all live with them.
LOSS_BYTES_PER_LOGIT = 8
# drafter.objective dspark: its chunked loss (dspark_loss.py) peaks at 3.3-4.4 float32 arrays of
# chunk x V (the drafter's and the target's distributions, their logits and the backward's
# rebuilt ones; measured on an H200 at the 8B and 27B shapes, docs/algorithm.md "DSpark").
DSPARK_LOSS_BYTES_PER_LOGIT = 18
# Checked on an H200 with drafter.py at Qwen3.6-27B width, 2 layers: one forward + backward of
# 1 and 2 sequences (8192 block tokens each) peaked at 18.9 and 25.2 GiB over params, features and
# frozen head; these terms (saved activations + context + loss chunk + grads + autocast copies)
# give 19.0 and 25.9 GiB. The backward's own per-layer gradients never coincide with the loss
# chunk's peak, so no extra layer is counted.


# --------------------------------------------------------------------------------------------
# The target's layer choice and dtype
# --------------------------------------------------------------------------------------------

def _last_layer(cfg: Config, s: ModelShape) -> int:
    if drafter_objective.is_dspark(cfg):
        return s.layers - 1  # the post-norm last hidden state: every layer runs
    # Default ids (target.default_layer_ids) spread from 1 to N-3; a single one is N // 2.
    if cfg.target.layer_ids:
        return max(cfg.target.layer_ids)
    return s.layers // 2 if cfg.target.num_features == 1 else max(0, s.layers - 3)


def _target_dtype(cfg: Config, on_cuda: bool) -> str:
    return cfg.target.dtype if on_cuda else "float32"  # engine.py runs CPU targets in float32


# --------------------------------------------------------------------------------------------
# Per-role components
# --------------------------------------------------------------------------------------------

def _target_layer_transient(s: ModelShape, tokens: int, b: int, run_types: set[str],
                            attn_impl: str, max_length: int) -> int:
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
        # expanded to all heads for SDPA with a padding mask (2), attention out, gated out, o_proj,
        # and the float32 upcasts of q_norm and the RoPE split / concat temporaries (6).
        per_token = q * (2 if s.gated_q else 1) + 2 * q + 2 * q + q + (q if s.gated_q else 0)
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


def _target_components(cfg: Config, s: ModelShape, hf_config: dict, on_cuda: bool,
                       queued: int, quantized: bool) -> dict[str, int]:
    t, b = cfg.data.token_budget, dtype_bytes(_target_dtype(cfg, on_cuda))
    last = _last_layer(cfg, s) + 1
    run_types = set(s.layer_types[:last]) | {s.mlp_type(i) for i in range(last)}
    features = t * drafter_objective.feature_vectors(cfg, num_features(cfg)) * s.hidden * b
    return {
        **target_weight_parts(hf_config, _target_dtype(cfg, on_cuda), quantized),
        "residual stream": RESIDUAL_LIVE * t * s.hidden * b,
        "layer transient": _target_layer_transient(
            s, t, b, run_types, cfg.target.attn_implementation, cfg.data.max_length),
        # SDPA padding mask: one bool per (query, key) pair within each sequence; sum S^2 <= T*S.
        "attention mask": 0 if cfg.target.attn_implementation == "flash_attention_2"
        else t * cfg.data.max_length,
        "features": features,
        "hs queue": queued * features,
    }


def target_tensors(cfg: Config, target_hf_config: dict, on_cuda: bool = True,
                   quantized: bool | None = None) -> dict[str, int]:
    """A target device's planned tensors with one batch in flight and none queued, without the
    CUDA margins: what a lone forward holds (bench/moe_target.py measures against it)."""
    kept = on_cuda if quantized is None else quantized
    comps = _target_components(cfg, model_shape(target_hf_config), target_hf_config, on_cuda, 0,
                               kept)
    return {k: v for k, v in comps.items() if v}


def optimizer_component(cfg: Config, hf_config: dict) -> dict[str, int]:
    """{name: bytes} of the drafter's fp32 weights, gradients and optimizer state; DSpark's
    heads in a row of their own (AdamW's under either optimizer)."""
    t = model_shape(hf_config)
    heads = drafter_objective.dspark_head_params(cfg, drafter_shape(cfg, t).hidden, t.vocab)
    n_params = drafter_param_count(cfg, hf_config) - heads
    out = {DSPARK_HEADS: heads * ADAM_BYTES_PER_PARAM} if heads else {}
    if cfg.optim.name == "muon":
        matrices = drafter_matrix_param_count(cfg, hf_config)
        return {OPTIMIZER_COMPONENTS["muon"]: matrices * MUON_BYTES_PER_PARAM
                + (n_params - matrices) * ADAM_BYTES_PER_PARAM} | out
    return {OPTIMIZER_COMPONENTS["adamw"]: n_params * ADAM_BYTES_PER_PARAM} | out


OPTIMIZER_COMPONENTS = {"adamw": "drafter fp32+adam", "muon": "drafter fp32+muon"}
DSPARK_HEADS = "dspark heads fp32+adam"  # Markov head 2 x r x V, confidence head H + r + 1


def _drafter_pass(cfg: Config) -> tuple[int, int, int]:
    """(sequences in a typical full batch, sequences per forward/backward, blocks per sequence).

    A typical full batch: token_budget / max_length sequences of max_length tokens, each with
    min(anchors, length) blocks; trainer.py runs them in groups of micro_block_tokens block tokens
    (objective.sequences_per_group).
    """
    d, data = cfg.drafter, cfg.data
    seqs = max(1, min(data.max_seqs_per_batch, data.token_budget // data.max_length))
    blocks = min(d.num_anchors, data.max_length)
    per_pass = min(seqs, sequences_per_group(d.micro_block_tokens, blocks * d.block_size))
    return seqs, per_pass, blocks


def _drafter_components(cfg: Config, s: ModelShape, hf_config: dict,
                        on_cuda: bool) -> dict[str, int]:
    d, data = cfg.drafter, cfg.data
    ds = drafter_shape(cfg, s)
    n_params = drafter_param_count(cfg, hf_config)
    tb = dtype_bytes(_target_dtype(cfg, on_cuda))
    autocast = on_cuda and d.dtype == "bfloat16"
    _, per_pass, blocks = _drafter_pass(cfg)
    block_tokens = per_pass * blocks * d.block_size
    context_tokens = per_pass * data.max_length
    k = num_features(cfg)
    sent = drafter_objective.feature_vectors(cfg, k)  # what the target sends per token
    q, kv = ds.heads * ds.head_dim, ds.kv_heads * ds.head_dim
    saved = (DRAFTER_SAVED_H * ds.hidden + DRAFTER_SAVED_Q * q + DRAFTER_SAVED_KV * kv
             + DRAFTER_SAVED_I * ds.intermediate)
    context = (CONTEXT_ONCE_KH * k * s.hidden + CONTEXT_ONCE_H * ds.hidden
               + d.num_layers * (CONTEXT_LAYER_H * ds.hidden + CONTEXT_LAYER_KV * kv))
    # trainer.py copies one group's features while the group before it computes: two live.
    features = 2 * context_tokens * sent * s.hidden * tb
    per_logit = (DSPARK_LOSS_BYTES_PER_LOGIT if drafter_objective.is_dspark(cfg)
                 else LOSS_BYTES_PER_LOGIT)
    return {
        **optimizer_component(cfg, hf_config),
        "autocast copies": n_params * AUTOCAST_COPY_BYTES if autocast else 0,
        "embed+lm_head": s.vocab * s.hidden * tb * (1 if s.tied else 2),
        "block activations": block_tokens * d.num_layers * saved * UNIT_BYTES,
        "context": context_tokens * context * UNIT_BYTES,
        "loss chunk": min(d.loss_chunk, block_tokens) * s.vocab * per_logit,
        "received features": features,
    }


# --------------------------------------------------------------------------------------------
# The plan
# --------------------------------------------------------------------------------------------

@dataclass
class PlanRow:
    device: str  # "cuda:N" or "cpu"
    role: str  # target | drafter | target+drafter
    components: dict[str, int]  # ordered name -> bytes
    # Bytes this process may use: free before loading, capped by layout.gpu_memory_gib; None =
    # unknown (not checked).
    free: int | None = None
    capacity: int | None = None  # the card's size, or the rehearsed card's limit, for display

    @property
    def total(self) -> int:
        return sum(self.components.values())

    @property
    def fits(self) -> bool:
        return self.free is None or self.total <= self.free

    @property
    def headroom(self) -> int | None:
        """Bytes left under the usable memory at the planned peak (negative: over)."""
        return None if self.free is None else self.free - self.total

    def to_dict(self) -> dict[str, Any]:
        return {"device": self.device, "role": self.role, "components": dict(self.components),
                "total": self.total, "free": self.free, "fits": self.fits,
                "capacity": self.capacity, "headroom": self.headroom}


@dataclass
class Overflow:
    """Devices the plan does not fit (a group with identical role, components and free memory),
    and what would make it fit."""

    devices: list[str]
    row: PlanRow  # the first device's row
    lower: list[tuple[str, Any]]  # (config key, its value now), biggest lever first; at most 3
    separate_roles: bool  # targets and drafters share a GPU: putting them on different ones helps
    weights_too_big: bool  # the weights alone exceed the free memory


@dataclass
class Plan:
    rows: list[PlanRow]
    token_budget: int
    logits_extra: int  # bytes full target logits would add on each target GPU (target dtype)
    logits_upcast_extra: int  # and the float32 copy HF's loss path makes on top of that
    overflows: list[Overflow]  # one per group of devices that does not fit, in device order

    @property
    def fits(self) -> bool:
        return all(r.fits for r in self.rows)

    @property
    def key(self) -> str | None:
        """The config key to change first: the biggest lever of the first group that does not
        fit (None when the plan fits, or nothing in config.yaml would shrink it)."""
        return next((o.lower[0][0] for o in self.overflows if o.lower), None)

    def row(self, device: str) -> PlanRow:
        for r in self.rows:
            if r.device == device:
                return r
        raise KeyError(device)

    def to_event_rows(self) -> list[dict[str, Any]]:
        return [r.to_dict() for r in self.rows]


def _device_type(cfg: Config, free_bytes: dict[str, int] | None) -> str:
    if cfg.layout.device != "auto":
        return cfg.layout.device
    if free_bytes:
        return "cuda" if any(k.startswith("cuda") for k in free_bytes) else "cpu"
    import torch  # only to answer "auto" when the caller gave no device facts

    return "cuda" if torch.cuda.is_available() else "cpu"


def plan_memory(cfg: Config, target_hf_config: dict, free_bytes: dict[str, int] | None = None,
                total_bytes: dict[str, int] | None = None, quantized: bool | None = None) -> Plan:
    """Estimate each device's peak bytes for this config and target.

    Queued feature batches stay on the target that made them (engine.py): each target keeps its
    share, ceil(layout.hs_queue / targets) batches, until a drafter takes them (targets of similar
    speed; one target alone could hold up to layout.hs_queue). ``quantized``: a quantized
    checkpoint's weights stay as stored (preflight knows whether transformers can run them on
    these devices); None = on CUDA yes, on the CPU no (transformers dequantizes there).
    """
    s = model_shape(target_hf_config)
    free_bytes, total_bytes = free_bytes or {}, total_bytes or {}
    dev = _device_type(cfg, free_bytes)
    on_cuda = dev == "cuda"
    lay = cfg.layout
    label = (lambda i: f"cuda:{i}") if on_cuda else (lambda i: "cpu")
    queued = math.ceil(lay.hs_queue / len(lay.targets))

    per_device: dict[str, tuple[list[str], dict[str, int]]] = {}

    def add(device: str, role: str, comps: dict[str, int]) -> None:
        roles, acc = per_device.setdefault(device, ([], {}))
        if role not in roles:
            roles.append(role)
        for name, nbytes in comps.items():
            acc[name] = acc.get(name, 0) + nbytes

    kept = on_cuda if quantized is None else quantized
    target = _target_components(cfg, s, target_hf_config, on_cuda, queued, kept)
    drafter = _drafter_components(cfg, s, target_hf_config, on_cuda)
    for i in lay.targets:
        add(label(i), "target", target)
    for i in lay.drafters:
        add(label(i), "drafter", drafter)

    rows = []
    for device in sorted(per_device, key=device_key):
        roles, comps = per_device[device]
        comps = {k: v for k, v in comps.items() if v}
        if on_cuda:
            comps |= cuda_margin(sum(comps.values()))
        rows.append(PlanRow(device, "+".join(sorted(roles, key=("target", "drafter").index)),
                            comps, free_bytes.get(device), total_bytes.get(device)))
    return Plan(rows=rows, token_budget=cfg.data.token_budget,
                logits_extra=full_logits_bytes(cfg.data.token_budget, s.vocab,
                                               _target_dtype(cfg, on_cuda)),
                logits_upcast_extra=full_logits_bytes(cfg.data.token_budget, s.vocab, "float32"),
                overflows=[_overflow(cfg, devices, r) for devices, r in device_groups(rows)
                           if not r.fits])


def device_groups(rows: list[PlanRow]) -> list[tuple[list[str], PlanRow]]:
    """Devices with identical role, components and free memory, so 7 equal targets read once."""
    groups: list[tuple[list[str], PlanRow]] = []
    for r in rows:
        for devices, first in groups:
            if (first.role, first.components, first.free) == (r.role, r.components, r.free):
                devices.append(r.device)
                break
        else:
            groups.append(([r.device], r))
    return groups


def device_key(device: str) -> tuple[str, int]:
    """("cuda", 3) for "cuda:3": devices sort by kind, then by index."""
    kind, _, idx = device.partition(":")
    return kind, int(idx) if idx.isdigit() else -1


# Which lever shrinks which component.
_LEVERS = {
    "residual stream": TOKEN_BUDGET, "layer transient": TOKEN_BUDGET,
    "attention mask": TOKEN_BUDGET, "features": TOKEN_BUDGET,
    "received features": TOKEN_BUDGET, "hs queue": HS_QUEUE,
    "loss chunk": LOSS_CHUNK,
    **{name: NUM_LAYERS for name in OPTIMIZER_COMPONENTS.values()},
}


def _activation_lever(cfg: Config) -> Lever:
    """The lever that bounds the drafter's block tokens (and context) per forward/backward."""
    seqs, per_pass, _ = _drafter_pass(cfg)
    if per_pass > 1:
        return TOKEN_BUDGET if per_pass == seqs else MICRO_BLOCK_TOKENS
    return NUM_ANCHORS  # already one sequence per pass


def _overflow(cfg: Config, devices: list[str], row: PlanRow) -> Overflow:
    """What to change for one overflowing group of devices, biggest lever first."""
    levers: dict[str, int] = {}
    for name, nbytes in row.components.items():
        lever = _activation_lever(cfg) if name in ("block activations", "context") \
            else _LEVERS.get(name)
        if lever:
            levers[lever.key] = levers.get(lever.key, 0) + nbytes
    ranked = sorted(levers, key=levers.get, reverse=True)[:3]
    fixed = sum(row.components.get(name, 0)
                for name in ("weights", "experts", *OPTIMIZER_COMPONENTS.values(),
                             DSPARK_HEADS))
    return Overflow(
        devices=devices, row=row, lower=[(k, key_value(cfg, k)) for k in ranked],
        separate_roles=row.role == "target+drafter" and row.device.startswith("cuda"),
        weights_too_big=row.free is not None and fixed > row.free)


# --------------------------------------------------------------------------------------------
# Sizes that fit
# --------------------------------------------------------------------------------------------

def fit_sizes(cfg: Config, target_hf_config: dict, free_bytes: dict[str, int] | None,
              total_bytes: dict[str, int] | None = None,
              quantized: bool | None = None) -> dict[str, int] | None:
    """The largest values of levers.FIT_LEVERS (each lowered by its own rule, Lever.lower)
    with which the plan fits: {} when it already fits, None when even the smallest do not."""
    trial = copy.deepcopy(cfg)
    changes: dict[str, int] = {}
    while True:
        plan = plan_memory(trial, target_hf_config, free_bytes, total_bytes, quantized)
        if plan.fits:
            return changes
        step = next(((lever.key, new) for row in plan.rows if not row.fits
                     for role in row.role.split("+") for lever in FIT_LEVERS[role]
                     if (new := lever.lower(trial)) is not None), None)
        if step is None:
            return None
        key, new = step
        set_key_value(trial, key, new)
        changes[key] = new
