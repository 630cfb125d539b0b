"""The DFlash2 drafter (docs/algorithm.md "DFlash2"): DFlash's drafter whose layers wrap each
sublayer in a block-position convolution (conv.py), and a candidate selector (selector.py) that
chooses each draft among the unary top-K by a greedy walk.

Layout as DFlash: a block is ``[token at anchor, MASK x (B-1)]`` at positions anchor..anchor+B-1,
slot k (1..B-1) drafts the token at anchor+k, B inputs give B-1 drafts. The anchor's own state
is never scored.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import torch
from safetensors.torch import load_file
from transformers import Qwen3Config

from dflash_core.families.dflash import ARCHITECTURE as DFLASH_ARCHITECTURE
from dflash_core.families.dflash2 import ARCHITECTURE, DFLASH2, DFlash2Settings
from dflash_core.models import served_keys as serving
from dflash_core.models.dflash.drafter import DFlashDrafter, build_drafter_config, qwen3_config_of
from dflash_core.models.dflash2 import format as d2format
from dflash_core.models.dflash2.conv import DFlash2Layer
from dflash_core.models.dflash2.loss import DFlash2StepLoss, dflash2_loss, predecessors
from dflash_core.models.dflash2.selector import CandidateSelector, candidates, unary, walk
from dflash_core.models.proposal import Proposal, block_states

# How a round chooses its drafts: the selector's walk (the method), or each slot's unary argmax
# (DFlash's choice on DFlash2's logits: what the selector gains is the difference).
PATHS = ("selector", "unary")


def with_settings(cfg: Qwen3Config, settings: DFlash2Settings) -> Qwen3Config:
    """A DFlash drafter config made DFlash2's: its architecture and the four keys."""
    settings.check(cfg.vocab_size, cfg.hidden_size)
    cfg.architectures = [ARCHITECTURE]
    cfg.dflash_config = {**cfg.dflash_config, "block_size": int(settings.block_size),
                         "conv_kernel_size": int(settings.conv_kernel_size),
                         "conv_group_size": int(settings.conv_group_size),
                         "selector_rank": int(settings.selector_rank),
                         "selector_top_k": int(settings.selector_top_k)}
    return cfg


class DFlash2Drafter(DFlashDrafter):
    family = DFLASH2
    objective = DFLASH2.name
    anchor_predicts = DFLASH2.anchor_predicts
    step_loss_class = DFlash2StepLoss
    layer_class = DFlash2Layer
    # The codebooks are lookup tables over the vocabulary: AdamW, as speculators keeps them.
    adamw_only = ("candidate_selector",)
    # The families whose folders it can start from (drafter.init_from): DFlash's backbone is
    # its own with the convolutions at identity.
    starts_from = ("dflash",)

    def __init__(self, config: Qwen3Config):
        super().__init__(config)
        dc = config.dflash_config
        self.selector_top_k = int(dc["selector_top_k"])
        self.output_multiplier = float(dc.get("output_multiplier", 1.0))
        self.softcap = float(dc.get("final_logit_softcapping") or 0.0)
        # Made after DFlash's initialisation, so the backbone draws what DFlash's does.
        self.candidate_selector = CandidateSelector(config.hidden_size, config.vocab_size,
                                                    int(dc["selector_rank"]))
        self.candidate_selector.reset(getattr(config, "initializer_range", 0.02))
        self.path = "selector"

    def attach_target_head(self, embed_tokens, lm_head) -> None:
        refused = d2format.full_vocabulary_refusal(self.config.vocab_size, lm_head.out_features)
        if refused:
            raise ValueError(refused)
        super().attach_target_head(embed_tokens, lm_head)

    # -- config and format -----------------------------------------------------------------------
    @classmethod
    def new_config(cls, target_config, *, num_layers: int, target_layer_ids: list[int],
                   block_size: int, mask_token_id: int, settings: DFlash2Settings | None = None,
                   **widths) -> Qwen3Config:
        """DFlash's config with DFlash2's keys (``settings``: default DFlash2Settings() at
        ``block_size``)."""
        cfg = build_drafter_config(target_config, num_layers=num_layers,
                                   target_layer_ids=target_layer_ids, block_size=block_size,
                                   mask_token_id=mask_token_id, **widths)
        return with_settings(cfg, settings or DFlash2Settings(block_size=block_size))

    @classmethod
    def serve_config_of(cls, config: Qwen3Config) -> dict:
        return d2format.serve_config_of(config, DFlashDrafter.serve_config_of)

    @classmethod
    def config_from_dict(cls, d: dict) -> Qwen3Config:
        """The drafter's config from a served config.json, read as vLLM reads it (its block's
        causality honoured: served_keys.read); NotDFlash2 (a ValueError) naming what this
        engine cannot load."""
        d2format.check_serve_dict(d)
        try:
            rest, _ = serving.read(d, DFLASH2.name)
        except serving.ServedKeyRefused as exc:
            raise d2format.NotDFlash2(str(exc)) from exc
        rest.pop("draft_vocab_size", None)  # the target's (check_serve_dict): nothing to map
        cfg = qwen3_config_of(rest)
        cfg.architectures = [ARCHITECTURE]
        return cfg

    @classmethod
    def start_config(cls, config: dict, settings: DFlash2Settings | None = None) -> Qwen3Config:
        """The DFlash2 config of a drafter started from a DFlash folder's ``config``:
        its shape, layers and ids, with ``settings`` (default: DFlash2's at its block size)."""
        cfg = DFlashDrafter.config_from_dict(config)
        return with_settings(cfg, settings or DFlash2Settings(
            block_size=int(cfg.dflash_config["block_size"])))

    @classmethod
    def check_names(cls, names) -> None:
        d2format.check_tensor_names(names)

    @classmethod
    def load(cls, folder: str | Path, device="cpu") -> "DFlash2Drafter":
        folder = Path(folder)
        model = cls(cls.config_from_dict(json.loads((folder / "config.json").read_text())))
        state = load_file(str(folder / "model.safetensors"), device=str(device))
        cls.check_names(state)
        model.load_state_dict(state)
        return model.to(device)

    @classmethod
    def start_from(cls, folder: str | Path, settings: DFlash2Settings | None = None,
                   device="cpu") -> "DFlash2Drafter":
        """A DFlash2 drafter whose backbone is a DFlash folder's (drafter.init_from): the
        convolutions at identity and the selector at its start (the successor codebook zero:
        it picks the unary argmax), so it drafts what the DFlash drafter drafts."""
        folder = Path(folder)
        config = json.loads((folder / "config.json").read_text())
        if (config.get("architectures") or [DFLASH_ARCHITECTURE]) != [DFLASH_ARCHITECTURE]:
            raise ValueError(f"{folder} is not a DFlash drafter folder")
        model = cls(cls.start_config(config, settings))
        state = load_file(str(folder / "model.safetensors"), device=str(device))
        missing, unexpected = model.load_state_dict(state, strict=False)
        own = ("_conv.", "candidate_selector.")
        if unexpected or any(not any(o in k for o in own) for k in missing):
            raise ValueError(f"{folder}: not DFlash's tensors (unexpected {unexpected[:3]}, "
                             f"missing {[k for k in missing if not any(o in k for o in own)][:3]})")
        return model.to(device)

    # -- drafting ------------------------------------------------------------------------------
    @contextlib.contextmanager
    def unary_path(self):
        """Rounds draft each slot's unary argmax while inside (the evaluation's comparison)."""
        before, self.path = self.path, "unary"
        try:
            yield self
        finally:
            self.path = before

    def unary_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 u = softcap(m * lm_head(h)): [..., H] -> [..., V]."""
        w = self.lm_head.weight
        return unary(torch.nn.functional.linear(hidden.to(w.dtype), w), self.output_multiplier,
                     self.softcap)

    @torch.no_grad()
    def draft_batch(self, context: torch.Tensor, lengths: list[int], last: list[int],
                    temperature: float = 0.0, gens=None, *, path: str | None = None
                    ) -> Proposal:
        """Each row's B-1 drafts (models/proposal.py): the selector's walk over the slots' top-K
        (``path`` "unary": each slot's unary argmax instead; default the drafter's ``path``).
        At ``temperature`` each draft is drawn from softmax(S / T) over its K candidates, and
        that distribution, zero elsewhere, is the proposal rejection sampling reads."""
        path = path or self.path
        if path not in PATHS:
            raise ValueError(f"path {path!r}: use one of {', '.join(PATHS)}")
        hidden = block_states(self, context, lengths, last)[:, 1:]  # the drafted slots
        u = self.unary_logits(hidden)  # [m, N, V]
        if path == "unary":
            if temperature <= 0:
                return Proposal(u.argmax(-1), None)
            probs = torch.softmax(u / temperature, -1)
            toks = torch.stack([torch.multinomial(probs[i], 1, generator=g)[:, 0]
                                for i, g in enumerate(gens)])
            return Proposal(toks, probs)
        toks, q, C = self._walk(hidden, u, torch.tensor(last, device=u.device, dtype=torch.long),
                                temperature, gens)
        if q is None:
            return Proposal(toks, None)
        return Proposal(toks, torch.zeros_like(u).scatter_(-1, C, q))

    def _walk(self, hidden, u, anchor, temperature=0.0, gens=None):
        U, C = candidates(u, self.selector_top_k)
        toks, q = walk(self.candidate_selector, U, C, self.candidate_selector.gate(hidden),
                       anchor, temperature, gens)
        return toks, q, C

    @torch.no_grad()
    def block_choice(self, hidden: torch.Tensor, anchor_token: int) -> torch.Tensor:
        """The drafts a round takes from one block's states [1, B, H] (the training forward's):
        the selector's walk over slots 1..B-1 from ``anchor_token`` (check's probes compare it
        with ``draft``)."""
        h = hidden[:, 1:]
        anchor = torch.tensor([int(anchor_token)], device=h.device)
        return self._walk(h, self.unary_logits(h), anchor)[0][0]

    @torch.no_grad()
    def draft(self, context: torch.Tensor, last_token: int, num_tokens: int | None = None):
        """The walk's tokens after ``last_token`` at position S (context [1, S, k*H])."""
        p = self.draft_batch(context, [context.shape[1]], [int(last_token)])
        return p.tokens[0, : num_tokens or self.block_size - 1]

    def teacher_forced_tau(self, hidden: torch.Tensor, labels: torch.Tensor,
                           ids: torch.Tensor, anchors: torch.Tensor,
                           chunk: int) -> tuple[float, int]:
        """DFlash's, with the selector's teacher-forced choices (the previous token the
        data's), the path decoding takes."""
        with torch.no_grad():
            prev = predecessors(ids, anchors, labels.shape[-1]).to(hidden.device)
            out = dflash2_loss(hidden, labels.to(hidden.device), prev, self, gamma=1.0,
                               alpha=0.0, inject=False, chunk=chunk)
        return float(out.tau_sum), out.blocks
