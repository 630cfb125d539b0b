"""DSpark's two small heads on top of the DFlash backbone (docs/algorithm.md, DSpark).

- ``MarkovHead`` (the "vanilla" type): a low-rank bigram bias on the drafter's logits,
  ``bias(prev) = W2 W1[prev]`` with ``W1`` an embedding table ``[V, r]`` and ``W2`` a linear map
  ``r -> V`` without bias. It is what lets a one-pass block drafter make slot j depend on the
  token chosen at slot j-1.
- ``ConfidenceHead``: one logit per slot, ``w . [h_j ; W1[prev_j]] + b``, in float32; its sigmoid
  estimates the chance that draft j is accepted given that every draft before it was.

The module and parameter names are those of the served checkpoint (``markov_head.markov_w1``,
``markov_head.markov_w2``, ``confidence_head.proj``): dspark/format.py writes the state dict as is.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class MarkovHead(nn.Module):
    def __init__(self, vocab_size: int, rank: int):
        super().__init__()
        self.markov_w1 = nn.Embedding(vocab_size, rank)
        self.markov_w2 = nn.Linear(rank, vocab_size, bias=False)

    def embed(self, prev: torch.Tensor) -> torch.Tensor:
        """W1[prev]: [...] token ids -> [..., r]."""
        return self.markov_w1(prev.long())

    def bias(self, embedded: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """W2 applied to W1 rows: [..., r] -> [..., V], the matmul in ``dtype`` (the lm_head's,
        so a bf16 head gets a bf16 GEMM) or the weight's."""
        w = self.markov_w2.weight
        dt = dtype or w.dtype
        return F.linear(embedded.to(dt), w.to(dt))

    def forward(self, prev: torch.Tensor) -> torch.Tensor:
        return self.bias(self.embed(prev))


class ConfidenceHead(nn.Module):
    def __init__(self, input_dim: int):
        super().__init__()
        self.proj = nn.Linear(input_dim, 1)

    def forward(self, hidden: torch.Tensor, prev_embedded: torch.Tensor) -> torch.Tensor:
        """Logits [...] from hidden [..., H] and W1[prev] [..., r]. Always float32 (outside
        autocast): a probability read as an absolute value is not computed in bf16."""
        x = torch.cat([hidden, prev_embedded.to(hidden.dtype)], dim=-1)
        acc = torch.promote_types(x.dtype, torch.float32)
        with torch.autocast(x.device.type, enabled=False):
            w, b = self.proj.weight.to(acc), self.proj.bias.to(acc)
            return F.linear(x.to(acc), w, b).squeeze(-1)


def init_heads(markov: MarkovHead, confidence: ConfidenceHead | None, std: float) -> None:
    """N(0, std^2) for every weight, zero biases: what the reference's transformers init does
    for these layer types."""
    with torch.no_grad():
        nn.init.normal_(markov.markov_w1.weight, std=std)
        nn.init.normal_(markov.markov_w2.weight, std=std)
        if confidence is not None:
            nn.init.normal_(confidence.proj.weight, std=std)
            nn.init.zeros_(confidence.proj.bias)
