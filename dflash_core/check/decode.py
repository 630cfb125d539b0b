"""Exact decoding of the check's prompts, through this engine's drafter and through the public
reference implementation, with every proposal recorded.

Both go through the one decoding loop (``eval/spec_decode.decode_rows``, each sample a batch of
one: ``evaluate.speculative_generate``), which records every round's drafts; only the drafter
(and, for the reference, the way features are read from the target) changes: both are asked one
context at a time (``draft``). Since the loop's output is the
target's greedy text, the target's choice at every drafted position is known afterwards, so each
proposed token can be judged on its own (not only as part of the accepted prefix) and against its
neighbours (a proposal equal to the token one position later is the mark of shifted labels).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from pathlib import Path

import torch

from dflash_core.check.samples import CheckSample
from dflash_core.context_buckets import Buckets, ContextCounts
from dflash_core.eval.drafting import drafts_per_round
from dflash_core.eval.evaluate import TargetFn, anchors_of, speculative_generate

REFERENCE = "dflash==0.1.0"  # the public reference implementation (PyPI), dflash.model


class OneContext:
    """Our drafter asked one context at a time (its ``draft``), as the reference is: the two then
    decode through the same path and differ only in the drafter."""

    def __init__(self, inner):
        self.inner = inner
        self.block_size = inner.block_size
        self.target_layer_ids = list(inner.target_layer_ids)

    def parameters(self):
        return self.inner.parameters()

    def drafts_per_round(self, block_size: int) -> int:
        return drafts_per_round(self.inner, block_size)  # DSpark: the anchor slot drafts too

    def draft(self, context: torch.Tensor, last_token: int, num_tokens: int | None = None):
        return self.inner.draft(context, last_token, num_tokens)


@dataclass
class SampleDecode:
    tokens: list[int]  # what exact decoding produced (the target's greedy text)
    response: list[int]  # what the drafter was trained on
    acceptance: list[int]  # drafted tokens accepted, per round
    drafts: list[tuple[int, list[int]]]  # (anchor, proposed tokens) per round
    prompt_len: int

    @property
    def diverged_at(self) -> int | None:
        """First position where decoding left the trained text (numerics of the target)."""
        for j, (a, b) in enumerate(zip(self.tokens, self.response)):
            if a != b:
                return j
        return None


@dataclass
class DecodeResult:
    name: str
    block_size: int
    samples: list[SampleDecode] = field(default_factory=list)
    drafts: int = 0  # tokens a round proposes: B-1, or B for DSpark (0: B-1)
    # the context-length buckets its rounds are counted in (context_buckets.py; None: the
    # defaults)
    buckets: Buckets | None = None

    def __post_init__(self):
        self.drafts = self.drafts or self.block_size - 1

    def _rounds(self):
        """(anchor, proposed, accepted, text) of each round inside the trained text."""
        for s in self.samples:
            text = s.tokens
            end = s.prompt_len + (s.diverged_at if s.diverged_at is not None else len(text))
            full = [None] * s.prompt_len + text
            for (anchor, prop), acc in zip(s.drafts, s.acceptance):
                if anchor + 1 + len(prop) > end:  # past the trained text (or its divergence)
                    prop = prop[: max(0, end - anchor - 1)]
                    acc = min(acc, len(prop))
                if prop:
                    yield anchor, prop, acc, full

    @property
    def tau(self) -> float:
        rounds = [acc + 1 for _, _, acc, _ in self._rounds()]
        return sum(rounds) / len(rounds) if rounds else 0.0

    def by_context(self) -> list[dict]:
        """Tau per bucket of context length over the rounds ``tau`` counts (a round's position is
        one past its anchor)."""
        counts = ContextCounts(self.buckets or Buckets.of(None))
        for anchor, _, acc, _ in self._rounds():
            counts.add([anchor + 1], [acc])
        return counts.records()

    @property
    def ceiling(self) -> float:
        """The tau of these rounds had every proposal been accepted."""
        rounds = [len(p) + 1 for _, p, _, _ in self._rounds()]
        return sum(rounds) / len(rounds) if rounds else 0.0

    @property
    def share(self) -> float:
        """Tau as a share of its ceiling (1 = every proposed token accepted)."""
        return self.tau / self.ceiling if self.ceiling else 0.0

    def accepted_at(self) -> list[float]:
        """Per drafted token k = 1..drafts (DFlash's block slot k; DSpark's slot k-1): share of
        rounds proposing it that accepted it."""
        return self._per_slot(lambda k, anchor, prop, acc, full: acc >= k)

    def correct_at(self, offset: int = 0) -> list[float]:
        """Per slot k: share of proposals equal to the target's token at anchor + k + offset,
        whatever came before in the block (offset 1: the token one position later)."""
        def hit(k, anchor, prop, acc, full):
            pos = anchor + k + offset
            return 0 <= pos < len(full) and full[pos] is not None and prop[k - 1] == full[pos]
        return self._per_slot(hit)

    def _per_slot(self, fn) -> list[float]:
        n = self.drafts + 1
        num, den = [0] * n, [0] * n
        for anchor, prop, acc, full in self._rounds():
            for k in range(1, len(prop) + 1):
                den[k] += 1
                num[k] += bool(fn(k, anchor, prop, acc, full))
        return [num[k] / den[k] if den[k] else float("nan") for k in range(1, n)]

    @property
    def diverged(self) -> list[int]:
        return [s.diverged_at for s in self.samples if s.diverged_at is not None]


def decode(name: str, target_fn: TargetFn, drafter, samples: list[CheckSample], layer_ids,
           *, eos_token_id: int | None, device, buckets: Buckets | None = None) -> DecodeResult:
    """Exact decoding of each sample's prompt for as many tokens as its response;
    ``buckets``: the target's context-length buckets (context_buckets.py)."""
    out = DecodeResult(name, drafter.block_size,
                       drafts=drafts_per_round(drafter, drafter.block_size), buckets=buckets)
    for s in samples:
        r = speculative_generate(target_fn, OneContext(drafter), s.prompt, len(s.response),
                                 layer_ids, eos_token_id=eos_token_id, device=device)
        # (anchor, proposed tokens) of each round that drafted
        drafts = [(at, d) for at, d in zip(anchors_of(len(s.prompt), r.acceptance), r.drafts)
                  if d]
        out.samples.append(SampleDecode(r.tokens, s.response, list(r.acceptance), drafts,
                                        len(s.prompt)))
    return out


# --------------------------------------------------------------------------------------------
# The reference implementation
# --------------------------------------------------------------------------------------------

def reference_class():
    """``dflash.model.DFlashDraftModel`` of the reference package, or (None, why not)."""
    try:
        module = importlib.import_module("dflash.model")
        return module.DFlashDraftModel, ""
    except Exception as exc:  # not installed, or it does not import with this transformers
        return None, f"{type(exc).__name__}: {exc}"


class ReferenceDrafter:
    """The reference's draft model driven like ours: it gets [last token, MASK, ...] embedded
    with the target's embedding (the mask id from the checkpoint's config.json, as the reference
    reads it), positions 0..S+B-1 over context then block, and its logits through the target's
    lm_head (``compute_logits``)."""

    def __init__(self, model, embed: torch.nn.Module, lm_head: torch.nn.Module):
        self.model = model
        self.embed, self.lm_head = embed, lm_head
        self.block_size = int(model.block_size)
        self.target_layer_ids = [int(i) for i in model.target_layer_ids]
        self.mask_token_id = int(model.mask_token_id)

    def parameters(self):
        return self.model.parameters()

    @torch.no_grad()
    def draft(self, context: torch.Tensor, last_token: int, num_tokens: int | None = None):
        S, B = context.shape[1], self.block_size
        dev = next(self.model.parameters()).device
        ids = torch.full((1, B), self.mask_token_id, dtype=torch.long, device=dev)
        ids[0, 0] = int(last_token)
        dtype = next(self.model.parameters()).dtype
        noise = self.embed(ids.to(self.embed.weight.device)).to(dev, dtype)
        pos = torch.arange(S + B, device=dev)[None]
        hidden = self.model(position_ids=pos, noise_embedding=noise,
                            target_hidden=context.to(dev, dtype))
        head_dev = self.lm_head.weight.device
        logits = self.model.compute_logits(hidden[:, 1:].to(head_dev, self.lm_head.weight.dtype),
                                           self.lm_head)
        return logits[0].argmax(-1)[: num_tokens or B - 1]


def reference_target_fn(hf_model, layer_ids) -> TargetFn:
    """Logits and features read from the target the reference's way (its
    ``extract_context_feature`` over transformers' hidden states)."""
    from dflash.model import extract_context_feature

    ids = [int(i) for i in layer_ids]

    def fn(input_ids: torch.Tensor):
        with torch.inference_mode():
            out = hf_model(input_ids=input_ids.to(hf_model.device), output_hidden_states=True,
                           use_cache=False)
        return out.logits, extract_context_feature(out.hidden_states, ids)

    return fn


def load_reference(cls, folder: Path, embed, lm_head, device,
                   dtype: str = "float32") -> ReferenceDrafter:
    model = cls.from_pretrained(str(folder), dtype=getattr(torch, dtype)).to(device).eval()
    return ReferenceDrafter(model, embed, lm_head)
