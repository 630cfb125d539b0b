"""The memory plan's drafter terms: what a drafter GPU holds to train, from config dicts alone.

Apart from the target's (target_memory.py): the float32 weights with their gradients and
optimizer state (AdamW, or Muon; DSpark's heads in a row of their own), autocast's bf16 copies,
the borrowed embedding and lm_head, the activations autograd saves for one group of sequences,
the context, the loss chunk (the torch loss's float32 arrays, or what the fused loss holds:
drafter.fused_loss) and the features received; with the measurements their constants come
from. memory.py adds them to the target's per device.
"""

from __future__ import annotations

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
# Checked on an H200 with drafter.py at Qwen3.6-27B width, 2 layers: one forward + backward of
# 1 and 2 sequences (8192 block tokens each) peaked at 18.9 and 25.2 GiB over params, features and
# frozen head; these terms (saved activations + context + loss chunk + grads + autocast copies)
# give 19.0 and 25.9 GiB. The backward's own per-layer gradients never coincide with the loss
# chunk's peak, so no extra layer is counted.


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
DSPARK_HEADS = "dspark heads fp32+adam"  # Markov head 2 x r x V, confidence head H + r + 1


def drafter_pass(cfg: Config) -> tuple[int, int, int]:
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


def drafter_components(cfg: Config, s: ModelShape, hf_config: dict,
                       on_cuda: bool) -> dict[str, int]:
    d, data = cfg.drafter, cfg.data
    ds = drafter_shape(cfg, s)
    n_params = drafter_param_count(cfg, hf_config)
    tb = dtype_bytes(target_dtype(cfg, on_cuda))
    autocast = on_cuda and d.dtype == "bfloat16"
    _, per_pass, blocks = drafter_pass(cfg)
    block_tokens = per_pass * blocks * d.block_size
    context_tokens = per_pass * data.max_length
    k = num_features(cfg)
    sent = feature_vectors(cfg, k)  # what the target sends per token
    q, kv = ds.heads * ds.head_dim, ds.kv_heads * ds.head_dim
    saved = (DRAFTER_SAVED_H * ds.hidden + DRAFTER_SAVED_Q * q + DRAFTER_SAVED_KV * kv
             + DRAFTER_SAVED_I * ds.intermediate)
    context = (CONTEXT_ONCE_KH * k * s.hidden + CONTEXT_ONCE_H * ds.hidden
               + d.num_layers * (CONTEXT_LAYER_H * ds.hidden + CONTEXT_LAYER_KV * kv))
    # trainer.py copies one group's features while the group before it computes: two live.
    features = 2 * context_tokens * sent * s.hidden * tb
    family = family_of(cfg)
    if on_cuda and fused_loss.planned(d.fused_loss):
        # The fused loss: its chunk's logits in the lm_head's (the target's) dtype and the
        # rows' gradients held from forward to backward (at most a block token each).
        loss = family.fused_loss_bytes(d, min(d.loss_chunk, block_tokens), block_tokens,
                                       s.hidden, s.vocab, tb)
    else:
        loss = min(d.loss_chunk, block_tokens) * s.vocab * family.loss_bytes_per_logit
    return {
        **optimizer_component(cfg, hf_config),
        "autocast copies": n_params * AUTOCAST_COPY_BYTES if autocast else 0,
        "embed+lm_head": s.vocab * s.hidden * tb * (1 if s.tied else 2),
        "block activations": block_tokens * d.num_layers * saved * UNIT_BYTES,
        "context": context_tokens * context * UNIT_BYTES,
        "loss chunk": loss,
        "received features": features,
    }
