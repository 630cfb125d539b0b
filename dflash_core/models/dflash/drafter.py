"""The DFlash draft model and its interchange format (docs/algorithm.md).

A stack of Qwen3-style decoder layers without embedding or lm_head (both borrowed from the frozen
target). The k target features of each context token go through ``fc`` and ``hidden_norm``; in every
layer, the block tokens' queries attend to keys/values projected (with the same weights) from the
context and from the block itself. Blocks are bidirectional inside (causal when the config says so:
``dflash_config.causal``, read from a folder's ``is_causal``, models/served_keys.py) and see only
context before their anchor (block_attention.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn
from torch.utils.checkpoint import checkpoint
from transformers import Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import (
    Qwen3MLP,
    Qwen3RotaryEmbedding,
    rotate_half,
)

from dflash_core.models.block_attention import block_attention, make_block_mask, resolve_impl
from dflash_core.models import served_keys as serving
from dflash_core.models.rope_settings import config_kwargs, config_rope, drafter_rope, served_keys
from dflash_core.models.target.shape import drafter_intermediate, text_config
from dflash_core.families.dflash import ARCHITECTURE, DFLASH
from dflash_core.models.dflash.loss import DFlashStepLoss
from dflash_core.models.proposal import Proposal, block_states, probabilities



class RMSNorm(nn.Module):
    """Qwen3's RMSNorm (the same ``weight``, the same function, fp32 inside) through torch's fused
    kernel. transformers' eager version launches about six elementwise kernels forward and as many
    backward over fp32 copies of the activations: a fifth of the 8B-shaped drafter's GPU time in a
    profiled step (bench/BENCHMARKS.md). Unlike it, the normalised value is not rounded to the
    input's dtype before the weight multiplies it; the output dtype is the same."""

    def __init__(self, size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.variance_epsilon = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.promote_types(x.dtype, self.weight.dtype)
        return F.rms_norm(x.float(), (x.shape[-1],), self.weight.float(),
                          self.variance_epsilon).to(out)


def block_is_causal(config) -> bool:
    """Whether a drafter of ``config`` attends causally inside its block (its dflash_config's
    ``causal``; absent: bidirectional, as this engine trains)."""
    return bool((getattr(config, "dflash_config", None) or {}).get("causal", False))


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [n, h, T, d]; cos/sin: [n, T, d]
    return x * cos[:, None] + rotate_half(x) * sin[:, None]


class DrafterAttention(nn.Module):
    def __init__(self, config: Qwen3Config):
        super().__init__()
        self.head_dim = config.head_dim
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        H = config.hidden_size
        self.q_proj = nn.Linear(H, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(H, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(H, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, H, bias=False)
        self.q_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.scale = self.head_dim ** -0.5
        # a block position attends only to itself and those before it (served_keys.py)
        self.causal = block_is_causal(config)

    def _heads(self, x: torch.Tensor, n_heads: int) -> torch.Tensor:
        n, T, _ = x.shape
        return x.view(n, T, n_heads, self.head_dim)

    def forward(self, x, ctx, rope_blk, rope_ctx, anchors, block_size, impl, block_mask=None):
        """``ctx``: the context, or (its handle for k_proj, its handle for v_proj): one node each,
        so their gradients meet in float32 (DFlashDrafter.forward, _SharedCast)."""
        ctx_k, ctx_v = ctx if isinstance(ctx, tuple) else (ctx, ctx)
        q = self.q_norm(self._heads(self.q_proj(x), self.num_heads)).transpose(1, 2)
        k_blk = self.k_norm(self._heads(self.k_proj(x), self.num_kv_heads)).transpose(1, 2)
        k_ctx = self.k_norm(self._heads(self.k_proj(ctx_k), self.num_kv_heads)).transpose(1, 2)
        v_blk = self._heads(self.v_proj(x), self.num_kv_heads).transpose(1, 2)
        v_ctx = self._heads(self.v_proj(ctx_v), self.num_kv_heads).transpose(1, 2)
        q, k_blk = _rope(q, *rope_blk), _rope(k_blk, *rope_blk)
        k_ctx = _rope(k_ctx, *rope_ctx)
        dev = q.device.type
        if torch.is_autocast_enabled(dev):
            # The fp32 norm weights lift q/k back to fp32 and attention kernels are not covered
            # by autocast: cast explicitly so attention runs in bf16 on tensor cores.
            dt = torch.get_autocast_dtype(dev)
            q, k_blk, k_ctx, v_blk, v_ctx = (t.to(dt) for t in (q, k_blk, k_ctx, v_blk, v_ctx))
        out = block_attention(q, k_ctx, v_ctx, k_blk, v_blk, anchors, block_size, self.scale, impl,
                              block_mask, causal=self.causal)
        n, _, T, _ = out.shape
        return self.o_proj(out.transpose(1, 2).reshape(n, T, -1))


class _SharedCast(torch.autograd.Function):
    """One projection's handle on the context cast once to the autocast dtype (``low``, shared
    by every layer: k_proj and v_proj keep it, not a cast copy of their own). Backward returns
    the projection's gradient in ``full``'s dtype, so the gradients add up in float32 as
    autocast's own casts would have them: the same numbers, one copy of the context."""

    @staticmethod
    def forward(ctx, full: torch.Tensor, low: torch.Tensor) -> torch.Tensor:
        ctx.dtype = full.dtype
        return low.view_as(low)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad.to(ctx.dtype), None


class DrafterLayer(nn.Module):
    def __init__(self, config: Qwen3Config):
        super().__init__()
        self.self_attn = DrafterAttention(config)
        self.mlp = Qwen3MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, x, ctx, rope_blk, rope_ctx, anchors, block_size, impl, block_mask=None):
        # The context skips input_layernorm: it was normalised once by hidden_norm.
        x = x + self.self_attn(self.input_layernorm(x), ctx, rope_blk, rope_ctx, anchors,
                               block_size, impl, block_mask)
        return x + self.mlp(self.post_attention_layernorm(x))


def build_drafter_config(target_config, *, num_layers: int, target_layer_ids: list[int],
                         block_size: int, mask_token_id: int, hidden_size: int = 0,
                         intermediate_size: int = 0, num_attention_heads: int = 0,
                         num_key_value_heads: int = 0) -> Qwen3Config:
    """A Qwen3 config for the drafter, shaped like the target unless overridden; its rotary
    settings and position window are the target's (rope_settings.py)."""
    tc = text_config(target_config)
    H = hidden_size or tc.hidden_size
    heads = num_attention_heads or tc.num_attention_heads
    head_dim = getattr(tc, "head_dim", None) or H // heads
    cfg = Qwen3Config(
        vocab_size=tc.vocab_size,
        hidden_size=H,
        intermediate_size=intermediate_size or drafter_intermediate(tc),  # MoE: target/shape.py
        num_hidden_layers=num_layers,
        num_attention_heads=heads,
        num_key_value_heads=num_key_value_heads or tc.num_key_value_heads,
        head_dim=head_dim,
        rms_norm_eps=tc.rms_norm_eps,
        max_position_embeddings=tc.max_position_embeddings,
        rope_parameters=drafter_rope(tc),
        attention_bias=False,
        tie_word_embeddings=False,
    )
    cfg.architectures = [ARCHITECTURE]
    cfg.num_target_layers = tc.num_hidden_layers
    cfg.dflash_config = {
        "target_layer_ids": list(target_layer_ids),
        "block_size": int(block_size),
        "mask_token_id": int(mask_token_id),
    }
    return cfg


def qwen3_config_of(d: dict) -> Qwen3Config:
    """The Qwen3 config of a config.json already judged (served_keys.read's): its dflash_config
    and num_target_layers as attributes."""
    d = config_kwargs(d)
    extra = {k: d.pop(k) for k in ("dflash_config", "num_target_layers") if k in d}
    cfg = Qwen3Config(**{k: v for k, v in d.items()
                         if k not in ("model_type", "transformers_version")})
    cfg.dflash_config = extra["dflash_config"]
    cfg.num_target_layers = extra.get("num_target_layers", 0)
    cfg.architectures = [ARCHITECTURE]
    return cfg


class DFlashDrafter(nn.Module):
    """The trainable part of DFlash. ``embed_tokens`` / ``lm_head`` are attached from the target
    with ``attach_target_head`` and are never trained or saved.

    Every family's drafter answers, for the trainer, the pipeline and check (none of which
    names a family): ``family`` (families/), ``objective``, ``anchor_predicts``,
    ``label_width``, ``drafts_per_round``, ``feature_vectors``, ``frozen_keys`` /
    ``frozen_tensors()`` / ``frozen_numel()``, ``step_loss(dcfg, settings)`` and
    ``step_stats``, ``family_probes(...)``, and the classmethods ``new_config`` and
    ``serve_config_of``. A family's step loss has ``stats``, ``settings``,
    ``check_features``, ``targets`` and is called on a micro-group's forward (loss.py)."""

    # The family it answers for (families/): its name, what it predicts at the anchor, ...
    family = DFLASH
    objective = DFLASH.name
    # Slot 0 (the anchor) is input only: B inputs give B-1 drafts (DSpark's slot 0 predicts).
    anchor_predicts = DFLASH.anchor_predicts
    # The target's tensors its served folder carries (frozen copies: served, never trained).
    frozen_keys: tuple[str, ...] = ()
    step_loss_class = DFlashStepLoss
    # Its decoder layer (a family may wrap DFlash's: DFlash2's convolutions).
    layer_class: type[nn.Module] = DrafterLayer

    def __init__(self, config: Qwen3Config):
        super().__init__()
        self.config = config
        dc = config.dflash_config
        self.target_layer_ids = list(dc["target_layer_ids"])
        self.block_size = int(dc["block_size"])
        self.mask_token_id = int(dc["mask_token_id"])
        self.causal = block_is_causal(config)
        H = config.hidden_size
        self.layers = nn.ModuleList(self.layer_class(config)
                                    for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(H, eps=config.rms_norm_eps)
        self.fc = nn.Linear(len(self.target_layer_ids) * H, H, bias=False)
        self.hidden_norm = RMSNorm(H, eps=config.rms_norm_eps)
        self.rotary_emb = Qwen3RotaryEmbedding(config)
        self.attn_impl = "auto"
        # drafter.recompute: each layer recomputed in backward (set by the replica)
        self.recompute = False
        self._head: tuple[nn.Embedding, nn.Linear] | None = None
        self._init_weights()

    def _init_weights(self) -> None:
        std = getattr(self.config, "initializer_range", 0.02)
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, std=std)

    # -- what its family answers ------------------------------------------------------------------
    @property
    def label_width(self) -> int:
        """Width of the block labels (objective.block_labels) the loader prepares for it."""
        return self.family.label_width(self)

    @property
    def feature_vectors(self) -> int:
        """H-vectors per token it takes from the target (its layers', then the family's)."""
        return self.family.feature_vectors(len(self.target_layer_ids))

    def step_loss(self, dcfg, settings=None):
        """Its family's loss of one micro-group (``settings``: the family's, from the config)."""
        return self.step_loss_class(self, dcfg, settings)

    @property
    def step_stats(self) -> tuple[str, ...]:
        """The loss terms a step sums for it beside the shared statistics (replica.STATS)."""
        return self.step_loss_class.stats

    def frozen_tensors(self) -> dict[str, torch.Tensor] | None:
        """The target's tensors its served folder carries (None: none)."""
        return None

    def frozen_numel(self) -> int:
        return 0

    def family_probes(self, features: torch.Tensor, input_ids: torch.Tensor,
                      anchors: list[int]):
        """The family's own probes of a trained drafter on one sample (check's diagnosis;
        None: DFlash's faults are the shared probes')."""
        return None

    @classmethod
    def new_config(cls, target_config, *, num_layers: int, target_layer_ids: list[int],
                   block_size: int, mask_token_id: int, settings=None, **widths) -> Qwen3Config:
        """The config of a fresh drafter shaped like the target (``settings``: its family's)."""
        return build_drafter_config(target_config, num_layers=num_layers,
                                    target_layer_ids=target_layer_ids, block_size=block_size,
                                    mask_token_id=mask_token_id, **widths)

    @classmethod
    def serve_config_of(cls, config: Qwen3Config) -> dict:
        """The config.json a drafter of ``config`` writes (interchange_config's): the rotary
        settings in both spellings serving stacks read (rope_settings.served_keys), and every
        key that changes what a server computes, stated (served_keys.stated)."""
        out = config.to_dict()
        top, inner = serving.stated(cls.family.name, block_is_causal(config))
        out.update(top)
        out["architectures"] = [ARCHITECTURE]
        out["dflash_config"] = {**dict(config.dflash_config), **inner}
        out["num_target_layers"] = config.num_target_layers
        out.update(served_keys(config_rope(config)))
        return out

    # -- borrowed target parts ------------------------------------------------------------------
    def attach_target_head(self, embed_tokens: nn.Embedding, lm_head: nn.Linear) -> None:
        # Stored outside the module tree so they are not parameters of the drafter.
        embed_tokens.requires_grad_(False)
        lm_head.requires_grad_(False)
        self._head = (embed_tokens, lm_head)

    @property
    def embed_tokens(self) -> nn.Embedding:
        if self._head is None:
            raise RuntimeError("attach_target_head() first: the drafter borrows the target's embedding")
        return self._head[0]

    @property
    def lm_head(self) -> nn.Linear:
        if self._head is None:
            raise RuntimeError("attach_target_head() first: the drafter borrows the target's lm_head")
        return self._head[1]

    # -- forward -----------------------------------------------------------------------------------
    def forward(self, context: torch.Tensor, block_embeds: torch.Tensor,
                block_positions: torch.Tensor, anchors: torch.Tensor,
                context_positions: torch.Tensor | None = None) -> torch.Tensor:
        """context: [n, S, k*H] target features; block_embeds: [n, A*B, H]; block_positions:
        [n, A*B]; anchors: [n, A] (-1 for padding blocks). Returns final-normed hidden [n, A*B, H]."""
        n, S, _ = context.shape
        if context_positions is None:
            context_positions = torch.arange(S, device=context.device).expand(n, S)
        dev = context.device.type
        autocast = torch.is_autocast_enabled(dev)
        # Under autocast fc reads the features as they came (bf16): a float32 copy would be cast
        # straight back, and at 128k tokens the two copies are GiBs. Without it, fc's dtype.
        ctx = self.hidden_norm(self.fc(context if autocast else
                                       context.to(self.fc.weight.dtype)))
        x = block_embeds
        rope_ctx, rope_blk = self._rotations(ctx, x, context_positions, block_positions)
        impl = resolve_impl(self.attn_impl, x.device, self.config.head_dim)
        mask = (make_block_mask(anchors.to(x.device), S, self.block_size, causal=self.causal)
                if impl == "flex" else None)  # one mask for all layers
        if autocast:  # one low-precision copy of the context for every layer (_SharedCast)
            low = ctx.detach().to(torch.get_autocast_dtype(dev))
            ctxs = [(_SharedCast.apply(ctx, low), _SharedCast.apply(ctx, low))
                    for _ in self.layers]
        else:
            ctxs = [ctx] * len(self.layers)
        del ctx  # the float32 context is needed no further: only its gradient is
        recompute = self.recompute and torch.is_grad_enabled()
        for layer, c in zip(self.layers, ctxs):
            args = (x, c, rope_blk, rope_ctx, anchors, self.block_size, impl, mask)
            # Recomputed in backward: only the layer's inputs are kept until then.
            x = checkpoint(layer, *args, use_reentrant=False) if recompute else layer(*args)
        return self.norm(x)

    def _rotations(self, ctx, x, context_positions, block_positions):
        """cos / sin of the context's and the block's positions from one call, in float32, then
        each in its tensor's dtype: a scaling that depends on the longest position (dynamic NTK)
        then rotates both alike, as the reference's one call over all positions does."""
        S = context_positions.shape[1]
        block_positions = block_positions.to(context_positions.device)
        n = max(context_positions.shape[0], block_positions.shape[0])  # a row of 1 broadcasts
        pos = torch.cat([context_positions.expand(n, -1), block_positions.expand(n, -1)], 1)
        cos, sin = self.rotary_emb(ctx.new_empty(0, dtype=torch.float32), pos)
        return ((cos[:, :S].to(ctx.dtype), sin[:, :S].to(ctx.dtype)),
                (cos[:, S:].to(x.dtype), sin[:, S:].to(x.dtype)))

    def block_inputs(self, input_ids: torch.Tensor, anchors: torch.Tensor):
        """Block token ids [token at anchor, MASK, ...] and positions anchor..anchor+B-1."""
        B = self.block_size
        n, A = anchors.shape
        safe = anchors.clamp(min=0)
        ids = torch.full((n, A, B), self.mask_token_id, dtype=torch.long, device=input_ids.device)
        ids[:, :, 0] = torch.gather(input_ids, 1, safe)
        pos = safe[:, :, None] + torch.arange(B, device=anchors.device)
        return ids.view(n, A * B), pos.view(n, A * B)

    @torch.no_grad()
    def draft(self, context: torch.Tensor, last_token: int, num_tokens: int | None = None):
        """Greedy proposal of the B-1 tokens after ``last_token``, which sits at position S
        (context: [1, S, k*H] features of positions 0..S-1). Returns a LongTensor [B-1]."""
        S = context.shape[1]
        dev = context.device
        anchors = torch.tensor([[S]], device=dev)
        ids, pos = self.block_inputs(torch.full((1, S + 1), last_token, device=dev), anchors)
        hidden = self(context, self.embed_tokens(ids).to(self.fc.weight.dtype), pos, anchors)
        logits = self.lm_head(hidden[0, 1:].to(self.lm_head.weight.dtype))
        return logits.argmax(-1)[: num_tokens or self.block_size - 1]

    # -- interchange format -----------------------------------------------------------------------
    def interchange_config(self) -> dict:
        return self.serve_config_of(self.config)

    def interchange_state(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().contiguous().cpu() for k, v in self.state_dict().items()}

    def save(self, folder: str | Path) -> None:
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "config.json").write_text(json.dumps(self.interchange_config(), indent=2))
        save_file(self.interchange_state(), str(folder / "model.safetensors"))

    @classmethod
    def config_from_dict(cls, d: dict) -> Qwen3Config:
        """The drafter's config from its config.json, read as vLLM reads it
        (served_keys.read: its block's causality honoured, what this engine cannot compute
        refused as ServedKeyRefused); raises rope_settings.RopeConflict when its two spellings
        of the rotary settings differ."""
        return qwen3_config_of(serving.read(d, "dflash")[0])

    @classmethod
    def check_folder_files(cls, folder: str | Path) -> None:
        """What a folder holds beside its two files that a server reads (ServedKeyRefused)."""
        serving.check_files(Path(folder), cls.family.name)

    @classmethod
    def check_names(cls, names) -> None:
        """A family's own rule on its folder's tensor names, beyond fitting its modules (a
        ValueError naming the tensors); DFlash has none. Called with the safetensors header's
        names, so a folder is judged before any weight is read."""

    @classmethod
    def load(cls, folder: str | Path, device="cpu") -> "DFlashDrafter":
        folder = Path(folder)
        cfg = cls.config_from_dict(json.loads((folder / "config.json").read_text()))
        model = cls(cfg)
        model.load_state_dict(load_file(str(folder / "model.safetensors"), device=str(device)))
        return model.to(device)

    # -- evaluation: what a round drafts, a batch's drafts, the teacher-forced tau ----------------
    def drafts_per_round(self, block_size: int) -> int:
        """Tokens a round proposes at ``block_size``: slots 1..B-1 (block 1: plain decoding)."""
        return max(0, block_size - 1)

    @torch.no_grad()
    def draft_batch(self, context: torch.Tensor, lengths: list[int], last: list[int],
                    temperature: float = 0.0, gens=None) -> Proposal:
        """Each row's B-1 drafts (models/proposal.py): the argmax of slots 1..B-1, or at
        ``temperature`` one draw per slot from row i's generator ``gens[i]`` (the slots drawn
        independently, as the reference does)."""
        hidden = block_states(self, context, lengths, last)
        logits = self.lm_head(hidden[:, 1:].to(self.lm_head.weight.dtype))  # [m, B-1, V]
        if temperature <= 0:
            return Proposal(logits.argmax(-1), None)
        probs = probabilities(logits, temperature)
        toks = torch.stack([torch.multinomial(probs[i], 1, generator=g)[:, 0]
                            for i, g in enumerate(gens)])
        return Proposal(toks, probs)

    def teacher_forced_tau(self, hidden: torch.Tensor, labels: torch.Tensor,
                           ids: torch.Tensor, anchors: torch.Tensor,
                           chunk: int) -> tuple[float, int]:
        """(sum of tau, blocks) of teacher-forced blocks at ``anchors``: ``hidden`` the
        drafter's block states, ``labels`` ``label_width`` wide (objective.block_labels)."""
        from dflash_core.models import objective as obj

        out = obj.chunked_loss(hidden, labels, self.lm_head.weight, 1.0, chunk)
        return float(out.tau_sum), out.blocks
