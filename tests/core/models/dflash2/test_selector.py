"""The candidate selector: its greedy walk equals a brute-force walk over the whole lattice of
pair scores written from the formula; the unary transform's order (multiplier, then softcap)."""

import torch

from dflash_core.models.dflash2.selector import CandidateSelector, candidates, unary, walk

V, H, R, K, N, M = 50, 16, 4, 6, 5, 3


def selector(seed=0):
    torch.manual_seed(seed)
    s = CandidateSelector(H, V, R)
    with torch.no_grad():
        for p in s.parameters():
            p.normal_()
    return s


@torch.no_grad()
def brute_force(s, u, h, anchor):
    """Every row's path: the lattice S[p][a][b] = u_p[b] + sum_j A[a,j] (W_h h_p)_j B[b,j] over
    all predecessors a of the vocabulary and candidates b in top-K(u_p), then the walk
    a_0 = anchor, d_p = the candidate of largest S[p][a_{p-1}], in plain loops."""
    A, Bc, Wh = s.predecessor_codebook, s.successor_codebook, s.hidden_projection.weight
    out = []
    for i in range(u.shape[0]):
        prev, path = int(anchor[i]), []
        for p in range(u.shape[1]):
            cands = sorted(range(V), key=lambda b: -float(u[i, p, b]))[:K]
            gate = Wh @ h[i, p]
            lattice = {a: {b: float(u[i, p, b]) + sum(float(A[a, j] * gate[j] * Bc[b, j])
                                                      for j in range(R)) for b in cands}
                       for a in range(V)}
            row = lattice[prev]
            prev = max(cands, key=lambda b: row[b])
            path.append(prev)
        out.append(path)
    return out


def test_walk_equals_brute_force():
    s = selector()
    torch.manual_seed(1)
    u, h = torch.randn(M, N, V) * 3, torch.randn(M, N, H)
    anchor = torch.tensor([3, 17, 49])
    with torch.no_grad():
        U, C = candidates(u, K)
        toks, q = walk(s, U, C, s.gate(h), anchor)
    assert q is None
    assert toks.tolist() == brute_force(s, u, h, anchor)
    # the pair term changes choices here: the walk is not the unary argmax
    assert toks.tolist() != u.argmax(-1).tolist()


def test_sampled_walk_draws_among_the_candidates():
    s = selector(2)
    torch.manual_seed(3)
    u, h = torch.randn(M, N, V), torch.randn(M, N, H)
    with torch.no_grad():
        U, C = candidates(u, K)
        gens = [torch.Generator().manual_seed(i) for i in range(M)]
        toks, q = walk(s, U, C, s.gate(h), torch.tensor([1, 2, 3]), 0.8, gens)
    assert q.shape == (M, N, K) and torch.allclose(q.sum(-1), torch.ones(M, N))
    assert all(int(toks[i, p]) in C[i, p].tolist() for i in range(M) for p in range(N))


def test_unary_applies_the_multiplier_before_the_softcap():
    z = torch.tensor([10.0, -3.0, 0.5])
    assert torch.allclose(unary(z, 0.5, 2.0), 2.0 * torch.tanh(0.5 * z / 2.0))
    assert torch.equal(unary(z), z)
