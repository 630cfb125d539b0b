"""DFlash2's candidate selector (docs/algorithm.md "DFlash2"): per drafted slot p with final
hidden h_p,

    u_p = softcap(m * lm_head(h_p))               the unary logits (m, softcap: the config's)
    C_p = TopK(u_p, K),  U_p = u_p[C_p]           the candidates and their unary scores
    gamma_p = W_h h_p                             the context gate [r]
    S_p(a, b) = U_p(b) + <A[a] * gamma_p, B[b]>   for predecessor a and candidate b in C_p

A = predecessor_codebook, B = successor_codebook, each [V, r] (bare parameters: the served
names have no ``.weight``). Decoding walks greedily left to right: a_0 = the anchor token,
d_p = argmax_b S_p(a_{p-1}, b), a_p = d_p (never a search over paths: every implementation walks
so). At temperature T, d_p is drawn from softmax_k(S_p / T) over the K candidates, and that
distribution, zero off the candidates, is the draft's proposal for rejection sampling.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def unary(logits: torch.Tensor, multiplier: float = 1.0, softcap: float = 0.0) -> torch.Tensor:
    """float32 unary logits: the multiplier first, then the softcap (when above 0)."""
    u = logits.float()
    if multiplier != 1.0:
        u = u * multiplier
    if softcap > 0:
        u = softcap * torch.tanh(u / softcap)
    return u


class CandidateSelector(nn.Module):
    def __init__(self, hidden: int, vocab: int, rank: int):
        super().__init__()
        self.hidden_projection = nn.Linear(hidden, rank, bias=False)
        self.predecessor_codebook = nn.Parameter(torch.zeros(vocab, rank))
        self.successor_codebook = nn.Parameter(torch.zeros(vocab, rank))

    def reset(self, std: float) -> None:
        """The public trainers' start: the successor codebook zero (the pair term is 0: the
        selector picks the unary argmax), the gate and the predecessor codebook N(0, std^2)."""
        with torch.no_grad():
            nn.init.normal_(self.hidden_projection.weight, std=std)
            nn.init.normal_(self.predecessor_codebook, std=std)
            nn.init.zeros_(self.successor_codebook)

    def gate(self, hidden: torch.Tensor) -> torch.Tensor:
        """gamma = W_h h in float32: [..., H] -> [..., r]."""
        return F.linear(hidden.float(), self.hidden_projection.weight.float())

    def scores(self, U: torch.Tensor, cand: torch.Tensor, gate: torch.Tensor,
               prev: torch.Tensor) -> torch.Tensor:
        """S(prev, cand) in float32: U, cand [..., K]; gate [..., r]; prev [...] token ids."""
        a = self.predecessor_codebook[prev.long()].float() * gate  # [..., r]
        b = self.successor_codebook[cand.long()].float()  # [..., K, r]
        return U.float() + (b @ a[..., None]).squeeze(-1)


def candidates(u: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(U, C): the top ``k`` unary scores of u [..., V] and their token ids, best first."""
    U, C = u.topk(k, dim=-1)
    return U, C


def walk(selector: CandidateSelector, U: torch.Tensor, C: torch.Tensor, gate: torch.Tensor,
         anchor: torch.Tensor, temperature: float = 0.0, gens=None):
    """The greedy walk over rows' slots: U, C [m, N, K]; gate [m, N, r]; anchor [m] (the token
    before slot 1). Returns (tokens [m, N], q [m, N, K] or None): q the distribution over the
    candidates each token was drawn from (at ``temperature`` > 0, row i with ``gens[i]``)."""
    m, N, K = C.shape
    prev = anchor.long()
    tokens, dists = [], []
    for p in range(N):
        s = selector.scores(U[:, p], C[:, p], gate[:, p], prev)  # [m, K]
        if temperature <= 0:
            k = s.argmax(-1)
        else:
            q = torch.softmax(s / temperature, dim=-1)
            k = torch.stack([torch.multinomial(q[i], 1, generator=g)[0]
                             for i, g in enumerate(gens)])
            dists.append(q)
        prev = C[:, p].gather(1, k[:, None]).squeeze(1)
        tokens.append(prev)
    return torch.stack(tokens, 1), (torch.stack(dists, 1) if dists else None)
