"""The memory plan's drafter terms: what a drafter GPU holds to train, from config dicts alone.

Apart from the target's (target_memory.py): the float32 weights with their gradients and
optimizer state (AdamW, or Muon; DSpark's heads in a row of their own), autocast's bf16 copies,
the borrowed embedding and lm_head, the features received and the context made from them, and
what one pass of forward + backward holds on top, in the phase where it holds the most:

- forward: every layer's saved activations (with drafter.recompute, only each layer's input)
  and the context path of the layer in flight;
- loss: the same, and one chunk of the loss's logits (the torch loss's float32 arrays, or what
  the fused loss holds: drafter.fused_loss);
- backward: the activations still saved (recomputed: the inputs and the one layer rebuilt), and
  the gradients of the layer being run back, over the whole context.

The plan's row holds the terms of the phase that peaks; ``drafter_phases`` gives all three, each
term named, so a measured peak per phase (bench/training/plan_vs_peak.py) checks each constant.
memory.py adds the row to the target's per device.

Calibrating: plan_vs_peak.py prints, per case, each phase's planned terms and its measured peak.
A gap that grows with the sample's length is a context constant's (CONTEXT_*: the loss and
forward phases read CONTEXT_LAYER_KV, the backward phase CONTEXT_BACKWARD_*); one that grows with
block tokens a block constant's (DRAFTER_SAVED_*, RECOMPUTE_INPUT_H, BLOCK_*); one that is the same
at every length the held terms' or the loss chunk's (the family's loss_bytes_per_logit); run it
with --recompute on and off to tell the kept layers from the rebuilt one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from dflash_core.anchor_counts import ANCHOR_PAD, anchors_for, pass_anchors
from dflash_core.config import Config
from dflash_core.families.registry import family_of, feature_vectors, head_params
from dflash_core.models.target.shape import (
    ModelShape, drafter_matrix_param_count, drafter_param_count, drafter_shape, model_shape,
    num_features,
)
from dflash_core.models.fused_loss import select as fused_loss
from dflash_core.models.objective import sequences_per_group
from dflash_core.planning.target_memory import target_dtype
from dflash_core.planning.weight_bytes import dtype_bytes


# Drafter training (autograd saves activations; optimizer states are fp32).
ADAM_BYTES_PER_PARAM = 16  # fp32 master weight 4 + fp32 grad 4 + AdamW exp_avg 4 + exp_avg_sq 4
# optim.name muon: a matrix entry has fp32 weight 4 + grad 4 + Muon's momentum 4; the norms stay on
# AdamW (16). Muon's Newton-Schulz work (a bf16 copy of one matrix and two square products, about
# 0.7 GiB for a 27B-shaped MLP matrix) lives only inside the optimizer step, after backward has
# freed the activations, so it never meets the peak counted here.
MUON_BYTES_PER_PARAM = 12
AUTOCAST_COPY_BYTES = 2  # autocast caches a bf16 copy of every fp32 weight for fwd + bwd
UNIT_BYTES = 2  # the terms below count 2-byte units: a float32 tensor counts 2

# Per block token per layer, the tensors autograd saves, measured on drafter.py under bf16
# autocast with saved_tensors_hooks, attention saving q, k, v, out as flex attention does. The
# residual stream is float32 (block embeddings enter as float32), so norms save float32 inputs,
# linears save bf16 casts, and RoPE makes float32 q / k: 9 x H (2 norms' inputs, residual,
# casts), 7 x heads*head_dim (q path, attention out), 11 x kv_heads*head_dim (block k / v path
# and the [context; block] concat), 4 x intermediate (gate, up, act(gate), product). The fused
# RMSNorm (drafter.py) saves only its float32 input (13 / 8 / 12 with transformers' norm).
DRAFTER_SAVED_H, DRAFTER_SAVED_Q, DRAFTER_SAVED_KV, DRAFTER_SAVED_I = 9, 7, 11, 4
# Per block token, once: the final normed states (float32), which the loss reads, and in
# backward their gradient and the residual stream's (float32 each).
BLOCK_FINAL_H, BLOCK_BACKWARD_H = 2, 4
# drafter.recompute: per block token per layer, the layer's input kept for the recompute (the
# float32 residual stream); the layer rebuilt in backward then holds DRAFTER_SAVED_* once.
RECOMPUTE_INPUT_H = 2
# drafter.recompute, backward, per context token: measured, not derived. On an H200 at the 27B
# shape (8 layers, one sample of 131,072 tokens; bench/training/plan_vs_peak.py, BENCHMARKS.md
# "Long context") the recomputed backward peaked 5.1 GiB (DFlash) and 7.2 GiB (DSpark) above the
# terms above: 4.1 and 5.7 x H per context token in 2-byte units. 6 covers both (the plan 3% and
# 0.4% over the peaks); which tensors they are is not yet known.
RECOMPUTE_BACKWARD_CONTEXT_H = 6
# Per token (context and blocks), once: RoPE's cos and sin in float32 (head_dim each).
ROPE_HEAD_DIM = 4
# Per context token, once (drafter.py): hidden_norm's float32 input and the one bf16 copy of the
# context every layer reads (_SharedCast). fc reads the features as received (counted there);
# without autocast on a GPU (drafter.dtype float32) fc keeps a float32 copy of them (2 x k*H).
CONTEXT_ONCE_H, CONTEXT_FP32_FEATURES = 3, 2
# Per context token per layer, saved: k_norm's float32 input (2) and the [context; block] keys and
# values attention keeps (1 + 1), x kv_heads*head_dim. Derived from the ops, as the block terms
# were; with the two casts per layer the old code made (2 x H more) it gave the 8B shape's
# measured slope at 32k-131k tokens within 2% (bench/BENCHMARKS.md, "Long context").
CONTEXT_LAYER_KV = 4
# The layer in flight, per context token: forward, its k path's float32 temporaries (k_norm's
# output, RoPE's two products and their sum) x kv; backward, the context's float32 gradient
# accumulating over the layers (2), one projection's bf16 input gradient and its float32 cast
# (1 + 2) x H, and attention's key / value gradients (2 x kv). Never live with the loss chunk.
CONTEXT_FORWARD_KV = 8
CONTEXT_BACKWARD_H, CONTEXT_BACKWARD_KV = 5, 2
# Short samples, checked on an H200 with drafter.py at Qwen3.6-27B width, 2 layers: one forward +
# backward of 1 and 2 sequences (8192 block tokens each) peaked at 18.9 and 25.2 GiB over params,
# features and frozen head; the block terms with the loss chunk give 19.0 and 25.9 GiB.

PHASES = ("forward", "loss", "backward")
RECEIVED = "received features"


def optimizer_component(cfg: Config, hf_config: dict) -> dict[str, int]:
    """{name: bytes} of the drafter's fp32 weights, gradients and optimizer state; DSpark's
    heads in a row of their own (AdamW's under either optimizer)."""
    t = model_shape(hf_config)
    heads = head_params(cfg, drafter_shape(cfg, t).hidden, t.vocab)
    n_params = drafter_param_count(cfg, hf_config) - heads
    out = {DSPARK_HEADS: heads * ADAM_BYTES_PER_PARAM} if heads else {}
    if cfg.optim.name == "muon":
        matrices = drafter_matrix_param_count(cfg, hf_config)
        return {OPTIMIZER_COMPONENTS["muon"]: matrices * MUON_BYTES_PER_PARAM
                + (n_params - matrices) * ADAM_BYTES_PER_PARAM} | out
    return {OPTIMIZER_COMPONENTS["adamw"]: n_params * ADAM_BYTES_PER_PARAM} | out


OPTIMIZER_COMPONENTS = {"adamw": "drafter fp32+adam", "muon": "drafter fp32+muon"}
# The family's own parameters (Family.head_params): DSpark's Markov head 2 x r x V and confidence
# head H + r + 1; DFlash2's convolutions and selector (its codebooks 2 x V x r)
DSPARK_HEADS = "family heads fp32+adam"


@dataclass(frozen=True)
class DrafterPass:
    """One forward + backward of a typical full batch's longest sequences: token_budget /
    max_length sequences of max_length tokens, each with its anchors at that length
    (anchor_counts.anchors_for), in groups of micro_block_tokens block tokens (trainer.py:
    objective.sequences_per_group), a sequence with more in passes of fewer anchors."""

    seqs: int  # sequences in the batch
    per_pass: int  # sequences one forward / backward takes
    blocks: int  # blocks (anchors) of one sequence
    pass_blocks: int  # of them in one pass
    block_size: int
    context: int  # tokens of one sequence's context

    @property
    def groups(self) -> int:
        return math.ceil(self.seqs / self.per_pass)

    @property
    def block_tokens(self) -> int:
        return self.per_pass * self.pass_blocks * self.block_size

    @property
    def context_tokens(self) -> int:
        return self.per_pass * self.context


def drafter_pass(cfg: Config) -> DrafterPass:
    d, data = cfg.drafter, cfg.data
    seqs = max(1, min(data.max_seqs_per_batch, data.token_budget // data.max_length))
    blocks = anchors_for(data.max_length, d.num_anchors, d.anchors_per_1k_tokens)
    per_pass = min(seqs, sequences_per_group(d.micro_block_tokens, blocks * d.block_size))
    pad = ANCHOR_PAD if cfg.layout.device != "cpu" else 1  # padded on GPU (replica.py)
    cols = pass_anchors(d.micro_block_tokens, blocks, d.block_size, pad)
    return DrafterPass(seqs, per_pass, blocks, cols, d.block_size, data.max_length)


def held_components(cfg: Config, s: ModelShape, hf_config: dict,
                    on_cuda: bool) -> dict[str, int]:
    """What the drafter GPU holds throughout a pass: weights, optimizer, borrowed head, the
    features received and the context made from them."""
    d = cfg.drafter
    ds = drafter_shape(cfg, s)
    tb = dtype_bytes(target_dtype(cfg, on_cuda))
    autocast = on_cuda and d.dtype == "bfloat16"
    p = drafter_pass(cfg)
    k = num_features(cfg)
    # replica.py copies the next group's features while a group computes: two live when the
    # batch has more than one group (the passes of one sequence share its features).
    copies = min(2, p.groups)
    per_ctx = CONTEXT_ONCE_H * ds.hidden + ROPE_HEAD_DIM * ds.head_dim
    if on_cuda and not autocast:
        per_ctx += CONTEXT_FP32_FEATURES * k * s.hidden
    return {
        **optimizer_component(cfg, hf_config),
        "autocast copies": drafter_param_count(cfg, hf_config) * AUTOCAST_COPY_BYTES
        if autocast else 0,
        "embed+lm_head": s.vocab * s.hidden * tb * (1 if s.tied else 2),
        RECEIVED: copies * p.context_tokens * feature_vectors(cfg, k) * s.hidden * tb,
        "context": p.context_tokens * per_ctx * UNIT_BYTES,
    }


def phase_components(cfg: Config, s: ModelShape, recompute: bool,
                     on_cuda: bool = False) -> dict[str, dict[str, int]]:
    """{phase: {term: bytes}}: what each phase of one pass holds beyond held_components."""
    d = cfg.drafter
    ds = drafter_shape(cfg, s)
    p = drafter_pass(cfg)
    Q, C, L = p.block_tokens, p.context_tokens, d.num_layers
    q, kv, H = ds.heads * ds.head_dim, ds.kv_heads * ds.head_dim, ds.hidden
    family = family_of(cfg)
    layer = math.ceil((DRAFTER_SAVED_H + family.layer_saved_h(d)) * H + DRAFTER_SAVED_Q * q
                      + DRAFTER_SAVED_KV * kv + DRAFTER_SAVED_I * ds.intermediate)
    once = BLOCK_FINAL_H * H + ROPE_HEAD_DIM * ds.head_dim
    u = UNIT_BYTES
    if recompute:
        kept = Q * (L * RECOMPUTE_INPUT_H * H + once) * u  # the layers' inputs, final states
        rebuilt = Q * layer * u  # the one layer recomputed in backward
        block = {"forward": kept, "loss": kept, "backward": kept + rebuilt}
        ctx_layer = C * CONTEXT_LAYER_KV * kv * u
        context = {"forward": 0, "loss": 0,
                   "backward": ctx_layer + C * RECOMPUTE_BACKWARD_CONTEXT_H * H * u}
    else:
        saved = Q * (L * layer + once) * u
        block = dict.fromkeys(PHASES, saved)
        context = dict.fromkeys(PHASES, C * L * CONTEXT_LAYER_KV * kv * u)
    if on_cuda and fused_loss.planned(d.fused_loss):
        # The fused loss: its chunk's logits in the lm_head's (the target's) dtype and the
        # rows' gradients held from forward to backward (at most a block token each).
        loss = family.fused_loss_bytes(d, min(d.loss_chunk, Q), Q, s.hidden, s.vocab,
                                       dtype_bytes(target_dtype(cfg, on_cuda)))
    else:
        loss = min(d.loss_chunk, Q) * s.vocab * family.loss_bytes_per_logit
    return {
        "forward": {"block activations": block["forward"],
                    "context activations": context["forward"],
                    "layer forward": C * CONTEXT_FORWARD_KV * kv * u},
        "loss": {"block activations": block["loss"],
                 "context activations": context["loss"], "loss chunk": loss},
        "backward": {"block activations": block["backward"],
                     "context activations": context["backward"],
                     "layer backward": (C * (CONTEXT_BACKWARD_H * H + CONTEXT_BACKWARD_KV * kv)
                                        + Q * BLOCK_BACKWARD_H * H) * u},
    }


def drafter_phases(cfg: Config, s: ModelShape, hf_config: dict, on_cuda: bool,
                   recompute: bool) -> dict[str, dict[str, int]]:
    """{phase: {term: bytes}}, each phase whole (held terms first), without the CUDA margin."""
    held = held_components(cfg, s, hf_config, on_cuda)
    return {ph: held | extra
            for ph, extra in phase_components(cfg, s, recompute, on_cuda).items()}


def peak_phase(phases: dict[str, dict[str, int]]) -> str:
    """The phase that holds the most (the first of equals, in PHASES order)."""
    return max(PHASES, key=lambda ph: sum(phases[ph].values()))


def drafter_components(cfg: Config, s: ModelShape, hf_config: dict, on_cuda: bool,
                       recompute: bool = False) -> dict[str, int]:
    """The drafter's row of the plan: the terms of its peak phase."""
    phases = drafter_phases(cfg, s, hf_config, on_cuda, recompute)
    return phases[peak_phase(phases)]
