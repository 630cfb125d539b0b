"""drafter.fused_loss on the GPU (models/fused_loss): the fused kernels agree with the torch path,
their reference, on the loss, its terms, teacher-forced tau and every gradient, for DFlash's CE
(fixed slot weights and D-PACE's), DSpark's CE + TV + confidence and DFlash2's CE + selector CE
(both label choices, with and without the multiplier and softcap), over ragged rows, masked
positions, chunk edges and vocabularies that are and are not a multiple of the kernels' block; in
bf16 (the engine's lm_head; relative 1e-3) and float32 (1e-5). At the 8B shape the fused loss holds
no more than the memory plan says and less than the torch loss, and runs faster; and the engine
trains with it, its first step's loss that of the torch loss.

    pytest -q -s tests/gpu/test_fused_loss_gpu.py     # -s prints the 8B shape's times and peaks
    pytest -q -s tests/gpu/test_fused_loss_gpu.py -k dflash2     # DFlash2's alone
"""

import math
import time
from pathlib import Path

import pytest
import torch

from dflash_core.families.registry import family
from dflash_core.models import objective as obj
from dflash_core.models.dspark import loss as dl
from dflash_core.models.dspark.heads import ConfidenceHead, MarkovHead
from dflash_core.models.fused_loss import select, triton_kernels
from dflash_core.observe.events import StepMetrics
from tests.core.engine_fixtures import make_config, make_data, make_target
from tests.gpu.watch import Watched

DEV = torch.device("cuda")
TOL = {torch.bfloat16: 1e-3, torch.float32: 1e-5}
DTYPES = [pytest.param(torch.bfloat16, id="bf16"), pytest.param(torch.float32, id="fp32")]
# (vocabulary, the kernels' largest block): a few partial blocks, one block of 4096 plus a
# partial one, and an exact multiple of the block (no partial block at all)
VOCABS = [pytest.param((1000, 256), id="V1000-block256"),
          pytest.param((5003, None), id="V5003"), pytest.param((4096, None), id="V4096")]
H = 64


@pytest.fixture(autouse=True)
def triton_is_here():
    assert select.triton_installed(), ("Triton is not installed, which torch's CUDA wheels ship: "
                                       "the fused loss cannot run (pip install triton)")


def vocab_block(monkeypatch, case) -> int:
    V, block = case
    if block is not None:
        monkeypatch.setattr(triton_kernels, "MAX_BLOCK", block)
    return V


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b||, in float64."""
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp(min=1e-30))


def ragged(V: int, B: int, seed: int):
    """ids, loss mask and anchors of 3 sequences of 48 tokens: prompts, a masked turn inside,
    a short sample padded from 30 on (its blocks cut there), anchors near the end and padding
    anchors (-1)."""
    g = torch.Generator().manual_seed(seed)
    n, L = 3, 48
    ids = torch.randint(0, V, (n, L), generator=g)
    mask = torch.ones(n, L, dtype=torch.long)
    mask[:, :4] = 0
    mask[0, 20:23] = 0
    mask[2, 30:] = 0
    anchors = torch.tensor([[4, 11, 17, 44], [6, 13, 29, 45], [5, 25, 27, -1]])
    return ids, mask, anchors, g


# ------------------------------------------------------------------------------------------------
# DFlash: chunked cross-entropy, fixed and D-PACE weights
# ------------------------------------------------------------------------------------------------

def dflash_pair(hidden, labels, W, chunk, dpace):
    """(loss out, hidden's gradient) of the torch path and of the fused one."""
    out = []
    for fused in (False, True):
        h = hidden.clone().requires_grad_()
        lo = obj.chunked_loss(h, labels, W, 4.0, chunk, dpace_alpha=0.5 if dpace else None,
                              fused=fused)
        (lo.loss * lo.weight_sum).backward()
        out.append((lo, h.grad))
    return out


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab", VOCABS)
@pytest.mark.parametrize("dpace", [False, True], ids=["dflash", "dpace"])
def test_dflash_fused_loss_agrees_with_the_torch_path(monkeypatch, dtype, vocab, dpace):
    V, B = vocab_block(monkeypatch, vocab), 6
    ids, mask, anchors, g = ragged(V, B, seed=V)
    labels = obj.block_labels(ids, mask, anchors, B).to(DEV)
    hidden = torch.randn(3, anchors.shape[1] * B, H, generator=g).to(DEV)
    W = (torch.randn(V, H, generator=g) * 0.3).to(DEV, dtype)
    N = int(obj.label_rows(labels.cpu(), 4.0, 0.5 if dpace else None).rows.numel())
    assert 20 < N < 3 * anchors.shape[1] * (B - 1)  # masked and cut slots left out
    tol = TOL[dtype]
    for chunk in (1, 7, N - 1, N, 4096):  # one row, ragged chunks, one short, exactly, one chunk
        (ref, g_ref), (got, g_got) = dflash_pair(hidden, labels, W, chunk, dpace)
        assert rel(got.loss, ref.loss) <= tol, (chunk, float(got.loss), float(ref.loss))
        assert rel(torch.as_tensor(got.weight_sum), torch.as_tensor(ref.weight_sum)) <= tol
        assert torch.equal(got.tau_sum, ref.tau_sum) and got.blocks == ref.blocks
        assert rel(g_got, g_ref) <= tol, (chunk, rel(g_got, g_ref))
        assert g_ref.abs().sum() > 0


def test_without_a_gradient_the_fused_loss_only_measures(monkeypatch):
    V, B = vocab_block(monkeypatch, (1000, 256)), 6
    ids, mask, anchors, g = ragged(V, B, seed=3)
    labels = obj.block_labels(ids, mask, anchors, B).to(DEV)
    hidden = torch.randn(3, anchors.shape[1] * B, H, generator=g).to(DEV)
    W = (torch.randn(V, H, generator=g) * 0.3).to(DEV, torch.bfloat16)
    for dpace in (None, 0.5):
        with torch.no_grad():
            ref = obj.chunked_loss(hidden, labels, W, 4.0, 7, dpace_alpha=dpace)
            got = obj.chunked_loss(hidden, labels, W, 4.0, 7, dpace_alpha=dpace, fused=True)
        assert rel(got.loss, ref.loss) <= 1e-3 and torch.equal(got.tau_sum, ref.tau_sum)
        assert got.loss.grad_fn is None


# ------------------------------------------------------------------------------------------------
# DSpark: CE + TV + confidence
# ------------------------------------------------------------------------------------------------

class Head:
    """What dspark_loss reads of a drafter: the frozen lm_head and the two heads (float32, as
    the replica trains them)."""

    def __init__(self, W, V, R, confidence, seed):
        torch.manual_seed(seed)
        width = W.shape[1]  # the drafter's hidden size: H here, the 8B shape's 4096 below
        self.lm_head = torch.nn.Linear(width, V, bias=False)
        self.lm_head.weight = torch.nn.Parameter(W, requires_grad=False)
        self.markov_head = MarkovHead(V, R).to(DEV)
        self.confidence_head = ConfidenceHead(width + R).to(DEV) if confidence else None
        with torch.no_grad():
            self.markov_head.markov_w1.weight.normal_(0, 1.0)
            self.markov_head.markov_w2.weight.normal_(0, 0.3)
            if confidence:
                self.confidence_head.proj.weight.normal_(0, 0.3)
                self.confidence_head.proj.bias.fill_(0.2)

    def params(self):
        heads = [self.markov_head.markov_w1.weight, self.markov_head.markov_w2.weight]
        if self.confidence_head is not None:
            heads += [self.confidence_head.proj.weight, self.confidence_head.proj.bias]
        return heads


def dspark_pair(hidden, last, pos, labels, prev, W, V, R, confidence, chunk):
    out = []
    for fused in (False, True):
        drafter = Head(W, V, R, confidence, seed=7)  # the same heads both times
        h = hidden.clone().requires_grad_()
        lo = dl.dspark_loss(h, last, pos, labels, prev, drafter, gamma=4.0,
                            loss_weights=(0.1, 0.9, 1.0), chunk=chunk, fused=fused)
        (lo.loss * lo.weight_sum).backward()
        out.append((lo, [h.grad] + [p.grad for p in drafter.params()]))
    return out


def dspark_inputs(V, dtype, seed, B=5):
    ids, mask, anchors, g = ragged(V, B + 1, seed)
    labels, prev = dl.dspark_targets(dl.wide_labels(ids, mask, anchors, B),
                                     dl.anchor_tokens(ids, anchors))
    n, A = anchors.shape
    pos = (anchors.clamp(min=0)[:, :, None] + torch.arange(B)).reshape(n, -1)
    hidden = torch.randn(n, A * B, H, generator=g)
    last = torch.randn(n, ids.shape[1], H, generator=g)  # the target's post-norm states
    W = torch.randn(V, H, generator=g) * 0.3
    N = int(dl.label_rows(labels, 4.0).rows.numel())
    return (hidden.to(DEV), last.to(DEV, dtype), pos.to(DEV), labels.to(DEV), prev.to(DEV),
            W.to(DEV, dtype), N)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab", VOCABS)
@pytest.mark.parametrize("confidence", [True, False], ids=["conf", "noconf"])
def test_dspark_fused_loss_agrees_with_the_torch_path(monkeypatch, dtype, vocab, confidence):
    V, R = vocab_block(monkeypatch, vocab), 16
    hidden, last, pos, labels, prev, W, N = dspark_inputs(V, dtype, seed=V + 1)
    assert 15 < N < labels.numel()  # masked and cut slots left out
    tol = TOL[dtype]
    for chunk in (1, 7, N - 1, N, 1024):
        (ref, g_ref), (got, g_got) = dspark_pair(hidden, last, pos, labels, prev, W, V, R,
                                                 confidence, chunk)
        assert rel(got.loss, ref.loss) <= tol, (chunk, float(got.loss), float(ref.loss))
        assert rel(got.terms, ref.terms) <= tol, (chunk, got.terms, ref.terms)
        assert got.weight_sum == ref.weight_sum and got.blocks == ref.blocks
        assert torch.equal(got.tau_sum, ref.tau_sum)
        names = ["hidden", "W1", "W2", "conf w", "conf b"]
        for name, a, b in zip(names, g_got, g_ref):
            assert rel(a, b) <= tol, (chunk, name, rel(a, b))
        assert ref.terms[1] > 0.1 * ref.weight_sum  # the distributions differ: TV is not idle
    if not confidence:
        assert got.terms[2] == 0


# ------------------------------------------------------------------------------------------------
# DFlash2: CE + the selector's K-way CE
# ------------------------------------------------------------------------------------------------

class Selector:
    """What dflash2_loss reads of a drafter: the frozen lm_head, the selector (float32, as the
    replica trains it) and its constants."""

    def __init__(self, W, V, R, K, seed, multiplier=1.0, softcap=0.0):
        from dflash_core.models.dflash2.selector import CandidateSelector

        torch.manual_seed(seed)
        width = W.shape[1]
        self.lm_head = torch.nn.Linear(width, V, bias=False)
        self.lm_head.weight = torch.nn.Parameter(W, requires_grad=False)
        self.candidate_selector = CandidateSelector(width, V, R).to(DEV)
        with torch.no_grad():  # away from the start (the successor codebook's zero)
            for p in self.params():
                p.normal_(0, 0.5)
        self.selector_top_k, self.output_multiplier, self.softcap = K, multiplier, softcap

    def params(self):
        c = self.candidate_selector
        return [c.hidden_projection.weight, c.predecessor_codebook, c.successor_codebook]


def dflash2_pair(hidden, labels, prev, W, V, R, K, chunk, inject, unary_map=(1.0, 0.0)):
    from dflash_core.models.dflash2.loss import dflash2_loss

    out = []
    for fused in (False, True):
        drafter = Selector(W, V, R, K, seed=5, multiplier=unary_map[0], softcap=unary_map[1])
        h = hidden.clone().requires_grad_()
        lo = dflash2_loss(h, labels, prev, drafter, gamma=4.0, alpha=0.7, inject=inject,
                          chunk=chunk, fused=fused)
        (lo.loss * lo.weight_sum).backward()
        out.append((lo, [h.grad] + [p.grad for p in drafter.params()]))
    return out


def dflash2_inputs(V, dtype, seed, B=6):
    from dflash_core.models.dflash2.loss import predecessors

    ids, mask, anchors, g = ragged(V, B, seed)
    labels = obj.block_labels(ids, mask, anchors, B)
    prev = predecessors(ids, anchors, B)
    hidden = torch.randn(3, anchors.shape[1] * B, H, generator=g)
    W = torch.randn(V, H, generator=g) * 0.3
    # every third labelled slot's label made one of its row's top-5 logits: the label is among
    # the candidates there and not elsewhere, both branches of the selector term run
    with torch.no_grad():
        top = (hidden.to(dtype).float() @ W.to(dtype).float().t()).topk(5).indices[..., 4]
    flat, src = labels.view(-1), top.reshape(-1)
    rows = torch.nonzero(flat != obj.IGNORE).squeeze(1)[::3]
    flat[rows] = src[rows]
    N = int((labels != obj.IGNORE).sum())
    return hidden.to(DEV), labels.to(DEV), prev.to(DEV), W.to(DEV, dtype), N


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab", VOCABS)
@pytest.mark.parametrize("inject", [False, True], ids=["drop", "inject"])
@pytest.mark.parametrize("unary_map", [(1.0, 0.0), (0.5, 3.0)], ids=["plain", "softcap"])
def test_dflash2_fused_loss_agrees_with_the_torch_path(monkeypatch, dtype, vocab, inject,
                                                       unary_map):
    """The candidates are the top-K of the same logits in both paths (the same GEMM into a
    buffer of the same rows), so the agreement is the rounding's, as DFlash's and DSpark's."""
    V, R, K = vocab_block(monkeypatch, vocab), 16, 8
    hidden, labels, prev, W, N = dflash2_inputs(V, dtype, seed=V + 2)
    tol = TOL[dtype]
    for chunk in (1, 7, N - 1, N, 4096):
        (ref, g_ref), (got, g_got) = dflash2_pair(hidden, labels, prev, W, V, R, K, chunk, inject,
                                                  unary_map)
        assert rel(got.loss, ref.loss) <= tol, (chunk, float(got.loss), float(ref.loss))
        assert rel(got.terms, ref.terms) <= tol, (chunk, got.terms, ref.terms)
        assert got.weight_sum == ref.weight_sum and got.blocks == ref.blocks
        assert torch.equal(got.tau_sum, ref.tau_sum)
        assert torch.equal(got.unary_tau_sum, ref.unary_tau_sum)
        for name, a, b in zip(["hidden", "gate", "predecessor", "successor"], g_got, g_ref):
            assert b.abs().sum() > 0, name
            assert rel(a, b) <= tol, (chunk, name, rel(a, b))
    assert 0 < float(ref.terms[2]) < ref.weight_sum  # labels in and out of the candidates


def test_the_dflash2_row_kernel_is_its_torch_twin(monkeypatch):
    """The Triton kernel against selector_rows.unary_rows_torch (the CPU's), directly: CE,
    logsumexp, argmax and the written gradient, with a partial block and the softcap."""
    from dflash_core.models.fused_loss import selector_rows as sr

    monkeypatch.setattr(triton_kernels, "MAX_BLOCK", 256)
    g = torch.Generator().manual_seed(11)
    for V, softcap in ((1000, 0.0), (1000, 2.5), (5003, 30.0)):
        z = (torch.randn(9, V, generator=g) * 4).to(DEV)
        labels = torch.randint(0, V, (9,), generator=g).to(DEV)
        coef = torch.rand(9, generator=g).to(DEV)
        outs = []
        for fn in (triton_kernels.unary_rows, sr.unary_rows_torch):
            buf = z.clone()
            ce, lse = (torch.empty(9, device=DEV) for _ in range(2))
            preds = torch.empty(9, dtype=torch.long, device=DEV)
            fn(buf, labels, coef, ce, preds, lse, 0.8, softcap, True)
            outs.append((buf, ce, lse, preds))
        (b1, c1, l1, p1), (b2, c2, l2, p2) = outs
        assert rel(c1, c2) <= 1e-6 and rel(l1, l2) <= 1e-6 and torch.equal(p1, p2)
        assert rel(b1, b2) <= 1e-5, (V, softcap, rel(b1, b2))


# ------------------------------------------------------------------------------------------------
# The 8B shape: memory against the plan and the torch loss, time against the torch loss
# ------------------------------------------------------------------------------------------------

def measure(run, reps: int = 3) -> tuple[float, int]:
    """(seconds per call, peak bytes over what was live before) of run(), after one warm-up."""
    run()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    t = time.perf_counter()
    for _ in range(reps):
        run()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / reps, torch.cuda.max_memory_allocated() - base


@pytest.mark.parametrize("objective", ["dflash", "dspark"])
def test_at_the_8b_shape_the_fused_loss_holds_what_the_plan_says_and_is_faster(objective):
    """One sequence of 512 anchors at Qwen3-8B's width and vocabulary, each family's chunk (the
    config's 4096 and DSpark's 1024), the lm_head in bf16 as the engine keeps it."""
    V, Hb, R = 151936, 4096, 256
    dspark = objective == "dspark"
    B, chunk = (7, 1024) if dspark else (16, 4096)
    g = torch.Generator().manual_seed(0)
    L, A = 3072, 512
    anchors = torch.sort(torch.randperm(L - B - 1, generator=g)[:A] + 1).values[None]
    ids = torch.randint(0, V, (1, L), generator=g)
    mask = torch.ones(1, L, dtype=torch.long)
    W = (torch.randn(V, Hb, generator=g) * 0.02).to(DEV, torch.bfloat16)
    hidden = torch.randn(1, A * B, Hb, generator=g).to(DEV)
    if dspark:
        labels, prev = dl.dspark_targets(dl.wide_labels(ids, mask, anchors, B),
                                         dl.anchor_tokens(ids, anchors))
        rows = dl.label_rows(labels, 4.0)
        pos = (anchors[:, :, None] + torch.arange(B)).reshape(1, -1).to(DEV)
        last = torch.randn(1, L, Hb, generator=g).to(DEV, torch.bfloat16)
        labels, prev = labels.to(DEV), prev.to(DEV)
    else:
        labels = obj.block_labels(ids, mask, anchors, B)
        rows = obj.label_rows(labels, 4.0)
        labels = labels.to(DEV)
    N = int(rows.rows.numel())
    results, grads = {}, {}
    for fused in (False, True):
        drafter = Head(W, V, R, True, seed=1) if dspark else None
        h = hidden.clone().requires_grad_()

        def run():
            h.grad = None
            if drafter is not None:
                for p in drafter.params():
                    p.grad = None
                lo = dl.dspark_loss(h, last, pos, labels, prev, drafter, gamma=4.0,
                                    loss_weights=(0.1, 0.9, 1.0), chunk=chunk, rows=rows,
                                    fused=fused)
            else:
                lo = obj.chunked_loss(h, labels, W, 4.0, chunk, rows=rows, fused=fused)
            (lo.loss * lo.weight_sum).backward()
            results[fused] = lo.loss.detach()

        results[(fused, "time")] = measure(run)
        grads[fused] = h.grad.clone()
        del drafter, h
    (t_torch, peak_torch), (t_fused, peak_fused) = results[(False, "time")], results[(True, "time")]
    plan = family(objective).fused_loss_bytes(
        type("D", (), {"markov_rank": R}), min(chunk, A * B), A * B, Hb, V, 2)
    # Beside what the plan counts: the rows' states gathered (float32) and their target states,
    # and the gradient of hidden (float32) with its scatter, which the torch path makes too.
    extra = N * Hb * (4 + 2) + 2 * A * B * Hb * 4 + (64 << 20)
    print(f"\n{objective} 8B shape, {N} rows, chunk {chunk}: torch {t_torch * 1e3:.1f} ms "
          f"peak {peak_torch / 2**30:.2f} GiB; fused {t_fused * 1e3:.1f} ms peak "
          f"{peak_fused / 2**30:.2f} GiB; plan's fused term {plan / 2**30:.2f} GiB")
    assert rel(results[True], results[False]) <= 1e-3
    assert rel(grads[True], grads[False]) <= 1e-3
    assert peak_fused <= plan + extra, (peak_fused, plan)
    assert peak_fused < 0.75 * peak_torch
    assert t_fused < t_torch


def test_at_the_8b_shape_the_dflash2_fused_loss_holds_what_the_plan_says_and_is_faster():
    """One micro-group of the bench's DFlash2 step (4 sequences x 512 anchors of B 8, drafter
    .micro_block_tokens 16384) at Qwen3-8B's width and vocabulary, the config's chunk 4096,
    rank 256, K 16, the lm_head in bf16."""
    from dflash_core.config import config_from_dict
    from dflash_core.models.dflash2.loss import dflash2_loss, predecessors

    V, Hb, R, K, B, chunk = 151936, 4096, 256, 16, 8, 4096
    g = torch.Generator().manual_seed(0)
    n, L, A = 4, 3072, 512
    anchors = torch.stack([torch.sort(torch.randperm(L - B - 1, generator=g)[:A] + 1).values
                           for _ in range(n)])
    ids = torch.randint(0, V, (n, L), generator=g)
    labels = obj.block_labels(ids, torch.ones(n, L, dtype=torch.long), anchors, B)
    rows = obj.label_rows(labels, 4.0)
    prev = predecessors(ids, anchors, B).to(DEV)
    labels = labels.to(DEV)
    W = (torch.randn(V, Hb, generator=g) * 0.02).to(DEV, torch.bfloat16)
    hidden = torch.randn(n, A * B, Hb, generator=g).to(DEV)
    N = int(rows.rows.numel())
    results, grads = {}, {}
    for fused in (False, True):
        drafter = Selector(W, V, R, K, seed=1)
        with torch.no_grad():
            for p in drafter.params():
                p.mul_(0.05)  # realistic scales: the pair term beside the unary logits
        h = hidden.clone().requires_grad_()

        def run():
            h.grad = None
            for p in drafter.params():
                p.grad = None
            lo = dflash2_loss(h, labels, prev, drafter, gamma=4.0, alpha=1.0, inject=False,
                              chunk=chunk, rows=rows, fused=fused)
            (lo.loss * lo.weight_sum).backward()
            results[fused] = lo.loss.detach()

        results[(fused, "time")] = measure(run)
        grads[fused] = [h.grad.clone()] + [p.grad.clone() for p in drafter.params()]
        del drafter, h
    (t_torch, peak_torch), (t_fused, peak_fused) = results[(False, "time")], results[(True, "time")]
    d = config_from_dict({"drafter": {"objective": "dflash2"}}).drafter
    plan = family("dflash2").fused_loss_bytes(d, min(chunk, A * B * n), A * B * n, Hb, V, 2)
    # Beside what the plan counts: the rows' states gathered (float32) and the gradient of
    # hidden (float32) with its scatter, which the torch path makes too.
    extra = N * Hb * 4 + 2 * n * A * B * Hb * 4 + (64 << 20)
    print(f"\ndflash2 8B shape, {N} rows, chunk {chunk}: torch {t_torch * 1e3:.1f} ms peak "
          f"{peak_torch / 2**30:.2f} GiB; fused {t_fused * 1e3:.1f} ms peak "
          f"{peak_fused / 2**30:.2f} GiB; plan's fused term {plan / 2**30:.2f} GiB")
    assert rel(results[True], results[False]) <= 1e-3
    for name, a, b in zip(["hidden", "gate", "predecessor", "successor"], grads[True],
                          grads[False]):
        assert rel(a, b) <= 1e-3, (name, rel(a, b))
    assert peak_fused <= plan + extra, (peak_fused, plan)
    assert peak_fused < 0.5 * peak_torch
    assert t_fused < t_torch


# ------------------------------------------------------------------------------------------------
# The engine trains with it
# ------------------------------------------------------------------------------------------------

def engine_steps(tmp_path: Path, objective: str, mode: str) -> list[StepMetrics]:
    # one target and one data folder for both modes (data folders are never overwritten)
    target, data = tmp_path / "target", tmp_path / "data"
    if not data.exists():
        make_target(target, head_dim=16)  # head_dim 16: compiled flex
        make_data(data)
    keys = {"drafter__markov_rank": 16} if objective == "dspark" else {}
    cfg = make_config(tmp_path / mode, target, data, layout__device="cuda",
                      target__dtype="bfloat16", drafter__objective=objective,
                      drafter__fused_loss=mode, run__max_steps=3, data__eval_prompts=0,
                      checkpoint__every=0, **keys)
    run = Watched()
    run.run(cfg, timeout=600)
    return run.of(StepMetrics)


@pytest.mark.parametrize("objective", ["dflash", "dspark", "dflash2"])
def test_the_engine_trains_with_the_fused_loss(tmp_path: Path, monkeypatch, objective):
    calls = []
    for name in ("ce_rows", "spark_rows", "unary_rows"):
        real = getattr(triton_kernels, name)

        def counted(*a, _real=real, _name=name, **k):
            calls.append((_name, torch.is_grad_enabled()))
            return _real(*a, **k)

        monkeypatch.setattr(triton_kernels, name, counted)
    fused = engine_steps(tmp_path, objective, "on")
    kernel = {"dspark": "spark_rows", "dflash2": "unary_rows"}.get(objective, "ce_rows")
    assert calls and {n for n, _ in calls} == {kernel}, calls[:4]
    ran = len(calls)
    plain = engine_steps(tmp_path, objective, "off")
    assert len(calls) == ran  # off: the torch loss, no kernel
    assert [s.step for s in fused] == [s.step for s in plain] == [1, 2, 3]
    for s in fused:
        assert all(math.isfinite(x) for x in (s.loss, s.grad_norm)) and s.grad_norm > 0
    # the first step trains the same batch from the same weights: the same loss
    assert fused[0].loss == pytest.approx(plain[0].loss, rel=1e-3)
    assert fused[0].tau_tf == pytest.approx(plain[0].tau_tf, rel=1e-3)
    terms = {"dspark": ("loss_ce", "loss_tv", "loss_conf"),
             "dflash2": ("loss_ce", "loss_sel", "loss_hit")}.get(objective, ())
    for name in terms:
        assert getattr(fused[0], name) == pytest.approx(getattr(plain[0], name), rel=1e-3)
