"""The DSpark drafter (docs/algorithm.md, DSpark): DFlash's backbone, anchor-as-first layout, a
Markov logit head and a confidence head.

Layout: a block is the same input as DFlash's, ``[token at anchor, MASK x (B-1)]`` at positions
anchor..anchor+B-1, but slot j (0-based) predicts the token at anchor+j+1. The anchor slot
predicts too: B inputs give B drafts, and a round verifies B+1 tokens.

Logits of slot j: ``lm_head(h_j) + W2 W1[prev_j]``, where ``prev_0`` is the anchor token and
``prev_j`` the token of slot j-1: the data's in training, the one just drafted in decoding (chain
drafting: one backbone pass, then B argmax steps through the Markov bias).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import safetensors.torch
import torch
from transformers import Qwen3Config

from dflash_core.models.dflash.drafter import DFlashDrafter, build_drafter_config
from dflash_core.models.dspark.heads import ConfidenceHead, MarkovHead, init_heads
from dflash_core.models.dspark import format as dspark_format
from dflash_core.models.dspark import probes as dspark_probes
from dflash_core.families.dspark import ARCHITECTURE, DSPARK, DSparkSettings
from dflash_core.models.dspark.format import MARKOV_HEAD_TYPE
from dflash_core.models.dspark.step_loss import DSparkStepLoss
from dflash_core.models.dspark.loss import slot_logits
from dflash_core.models.proposal import Proposal, block_states, pick

# How decoding feeds the Markov head: the drafted token (the method); the anchor for every slot,
# or no Markov bias at all (ablations: what the chained head adds, a probe of check).
MARKOV_PREV = ("drafted", "anchor", "none")


def build_dspark_config(target_config, *, num_layers: int, target_layer_ids: list[int],
                        mask_token_id: int, settings: DSparkSettings, hidden_size: int = 0,
                        intermediate_size: int = 0, num_attention_heads: int = 0,
                        num_key_value_heads: int = 0) -> Qwen3Config:
    """The drafter's Qwen3 config (shaped like the target unless overridden) with DSpark's
    entries as top-level attributes; ``dflash_config`` is kept for the shared backbone code and
    dropped from the served file (dspark/format.py)."""
    cfg = build_drafter_config(
        target_config, num_layers=num_layers, target_layer_ids=target_layer_ids,
        block_size=settings.block_size, mask_token_id=mask_token_id, hidden_size=hidden_size,
        intermediate_size=intermediate_size, num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads)
    settings.check(cfg.vocab_size)
    cfg.architectures = [ARCHITECTURE]
    cfg.markov_rank = int(settings.markov_rank)
    cfg.markov_head_type = MARKOV_HEAD_TYPE
    cfg.enable_confidence_head = settings.confidence_head
    cfg.confidence_head_with_markov = True
    cfg.num_anchors = int(settings.num_anchors)
    return cfg


@dataclass
class ChainDraft:
    """One round's proposal: the tokens, and per slot the confidence head's probability (None
    without a head) and the logits argmax was taken over (for probes)."""

    tokens: torch.Tensor  # [n] long
    confidences: torch.Tensor | None  # [n] float32
    logits: torch.Tensor  # [n, V] float32


class DSparkDrafter(DFlashDrafter):
    """DFlash's backbone plus the Markov and confidence heads; ``embed_tokens`` / ``lm_head`` are
    borrowed from the target as DFlash's are (and written into the served folder)."""

    family = DSPARK
    objective = DSPARK.name
    anchor_predicts = DSPARK.anchor_predicts
    frozen_keys = dspark_format.FROZEN_KEYS
    step_loss_class = DSparkStepLoss
    # Muon's advice: lookup tables, maps onto the vocabulary and vectors stay on AdamW.
    adamw_only = ("markov_head", "confidence_head")

    def __init__(self, config: Qwen3Config):
        super().__init__(config)
        self.markov_rank = int(config.markov_rank)
        H, V = config.hidden_size, config.vocab_size
        self.markov_head = MarkovHead(V, self.markov_rank)
        self.confidence_head = (ConfidenceHead(H + self.markov_rank)
                                if config.enable_confidence_head else None)
        init_heads(self.markov_head, self.confidence_head,
                   getattr(config, "initializer_range", 0.02))

    # Its labels (label_width) are DFlash-layout labels one slot wider: slot k (1..B) is the
    # token at anchor+k, i.e. the label of DSpark's slot k-1 (loss.dspark_targets).

    def frozen_tensors(self) -> dict[str, torch.Tensor]:
        return dspark_format.frozen_tensors(self)

    def frozen_numel(self) -> int:
        return dspark_format.frozen_numel(self.config)

    def family_probes(self, features: torch.Tensor, input_ids: torch.Tensor,
                      anchors: list[int]):
        """probes.py's probes of its chain drafting, Markov head and confidence head."""
        return dspark_probes.probe(self, features, input_ids, anchors)

    @classmethod
    def new_config(cls, target_config, *, num_layers: int, target_layer_ids: list[int],
                   block_size: int, mask_token_id: int, settings: DSparkSettings | None = None,
                   **widths) -> Qwen3Config:
        """DSpark takes its block size from ``settings`` (default DSparkSettings())."""
        return build_dspark_config(target_config, num_layers=num_layers,
                                   target_layer_ids=target_layer_ids, mask_token_id=mask_token_id,
                                   settings=settings or DSparkSettings(), **widths)

    @classmethod
    def serve_config_of(cls, config: Qwen3Config) -> dict:
        return dspark_format.serve_config_of(config)

    # -- heads ---------------------------------------------------------------------------------
    def markov_logits(self, hidden: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
        """float32 logits ``lm_head(h) + W2 W1[prev]``: hidden [..., H], prev [...]. The whole
        vocabulary per row: for decoding and tests (training goes through dspark_loss)."""
        return slot_logits(hidden, self.markov_head.embed(prev), self.lm_head.weight,
                           self.markov_head.markov_w2.weight)

    def confidence_logits(self, hidden: torch.Tensor, prev: torch.Tensor) -> torch.Tensor | None:
        if self.confidence_head is None:
            return None
        return self.confidence_head(hidden, self.markov_head.embed(prev))

    # -- decoding ------------------------------------------------------------------------------
    @torch.no_grad()
    def chain_draft(self, context: torch.Tensor, last_token: int, num_tokens: int | None = None,
                    markov_prev: str = "drafted") -> ChainDraft:
        """Greedy proposal of up to B tokens after ``last_token`` (at position S; context
        [1, S, k*H] features of positions 0..S-1): one row of ``draft_batch``."""
        p = self.draft_batch(context, [context.shape[1]], [last_token], num_tokens=num_tokens,
                             markov_prev=markov_prev, keep_logits=True)
        return ChainDraft(p.tokens[0], None if p.confidences is None else p.confidences[0],
                          p.logits[0])

    @torch.no_grad()
    def draft_with_confidence(self, context: torch.Tensor, last_token: int,
                              num_tokens: int | None = None):
        """(tokens [n], confidences [n] or None): what exact decoding records per round."""
        d = self.chain_draft(context, last_token, num_tokens)
        return d.tokens, d.confidences

    @torch.no_grad()
    def draft(self, context: torch.Tensor, last_token: int, num_tokens: int | None = None):
        """The chain's tokens, LongTensor [n <= B] (decoding's Drafter protocol)."""
        return self.chain_draft(context, last_token, num_tokens).tokens

    # -- served format -------------------------------------------------------------------------
    def interchange_config(self) -> dict:
        return dspark_format.serve_config(self)

    def save(self, folder: str | Path, dtype: torch.dtype | None = torch.bfloat16) -> None:
        dspark_format.save_folder(self, folder, dtype=dtype)

    @classmethod
    def config_from_dict(cls, d: dict) -> Qwen3Config:
        return dspark_format.config_from_serve_dict(d)

    @classmethod
    def load(cls, folder: str | Path, device="cpu") -> "DSparkDrafter":
        """The drafter of a served folder; its embed_tokens / lm_head copies are not loaded
        (attach the target's), see dspark_format.load_head for them."""
        folder = Path(folder)
        cfg = cls.config_from_dict(json.loads((folder / "config.json").read_text()))
        model = cls(cfg)
        state = safetensors.torch.load_file(str(folder / "model.safetensors"), device=str(device))
        for k in dspark_format.FROZEN_KEYS:
            state.pop(k, None)
        model.load_state_dict(state)  # bf16 files load into the float32 weights (copy_ casts)
        return model.to(device)

    # -- evaluation: what a round drafts, a batch's drafts, the teacher-forced tau ----------------
    def drafts_per_round(self, block_size: int) -> int:
        """The anchor slot predicts too: B drafts a round (block size 1: plain decoding)."""
        return block_size if block_size > 1 else 0

    @torch.no_grad()
    def draft_batch(self, context: torch.Tensor, lengths: list[int], last: list[int],
                    temperature: float = 0.0, gens=None, *, num_tokens: int | None = None,
                    markov_prev: str = "drafted", keep_logits: bool = False) -> Proposal:
        """Each row's chain (models/proposal.py): one backbone pass, then for slot j = 0.. the
        token of slot j's logits with the Markov head fed ``prev_j`` (the anchor for slot 0,
        then the token just drafted), by argmax or drawn at ``temperature`` with row i's
        generator ``gens[i]``; with a confidence head, each slot's confidence from the same
        inputs. ``num_tokens``: the first slots only; ``markov_prev`` other than "drafted" is an
        ablation (MARKOV_PREV); ``keep_logits``: each slot's logits too (probes)."""
        if markov_prev not in MARKOV_PREV:
            raise ValueError(f"markov_prev {markov_prev!r}: use one of {', '.join(MARKOV_PREV)}")
        n = min(num_tokens or self.block_size, self.block_size)
        hidden = block_states(self, context, lengths, last)
        w = self.lm_head.weight
        # slot_logits' formula, the lm_head GEMM once for all slots
        base = torch.nn.functional.linear(hidden[:, :n].to(w.dtype), w)
        base = base.to(torch.promote_types(base.dtype, torch.float32))  # [m, n, V]
        prev = torch.tensor(last, device=context.device, dtype=torch.long)
        tokens, probs, confs, rows = [], [], [], []
        for j in range(n):
            e = self.markov_head.embed(prev)
            logits = base[:, j]
            if markov_prev != "none":
                logits = logits + self.markov_head.bias(e, w.dtype).to(logits.dtype)
            if self.confidence_head is not None:
                confs.append(torch.sigmoid(self.confidence_head(hidden[:, j], e)))
            x, p = pick(logits, temperature, gens)
            tokens.append(x)
            probs.append(p)
            if keep_logits:
                rows.append(logits)
            if markov_prev == "drafted":
                prev = x
        return Proposal(torch.stack(tokens, 1),
                        torch.stack(probs, 1) if temperature > 0 else None,
                        torch.stack(confs, 1) if confs else None,
                        torch.stack(rows, 1) if rows else None)

    def teacher_forced_tau(self, hidden: torch.Tensor, labels: torch.Tensor,
                           ids: torch.Tensor, anchors: torch.Tensor,
                           chunk: int) -> tuple[float, int]:
        """DFlash's, with DSpark's labels (one slot wider in DFlash's layout,
        dspark_loss.dspark_targets) and its chain's teacher-forced predictions."""
        from dflash_core.models.dspark import loss as dspark_loss

        labels, prev = dspark_loss.dspark_targets(labels, dspark_loss.anchor_tokens(ids, anchors))
        preds = dspark_loss.teacher_forced_preds(self, hidden, prev, chunk)
        blocks = int((labels[..., 0] != dspark_loss.IGNORE).sum())
        return float(dspark_loss.tau_sum(preds, labels)), blocks
