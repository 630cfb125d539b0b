"""The memory plan at 8k-128k tokens a sample (issue 47): recomputing the drafter's layers
counted, each phase of a drafter pass named, preflight accepting what the plan fits and refusing
what it does not, density anchors sized at the longest sample, and what a 128k-token sample costs
the target."""

from __future__ import annotations

import pytest
import torch

from dflash_core.config import ConfigError, config_from_dict
from dflash_core.observe.events import Log, MemoryPlan
from dflash_core.planning.capacity_checks import check_memory
from dflash_core.planning.drafter_memory import (
    PHASES, drafter_components, drafter_pass, drafter_phases, peak_phase,
)
from dflash_core.planning.memory import fit_sizes, plan_memory
from dflash_core.planning.sample_length import STEP, longest_sample
from dflash_core.planning.target_memory import target_components
from dflash_core.models.target.shape import model_shape
from dflash_core.units import GiB

from ..models.target.test_model_shape import QWEN36_27B

H, V, K, KV = 5120, 248320, 5, 4 * 256  # the 27B shape: hidden, vocab, features, kv width
CAP = 95 * GiB  # a 96 GB card's usable share


def seed_drafter(length: int, **drafter) -> object:
    """The seed's DFlash drafter (27B shape, 8 layers, 512 anchors x 16, one sequence a pass,
    loss chunk 4096) on one target GPU and one drafter GPU, one sample of ``length`` tokens a
    batch."""
    d = {"objective": "dflash", "num_layers": 8, "num_anchors": 512, "block_size": 16,
         "micro_block_tokens": 8192, "loss_chunk": 4096} | drafter
    return config_from_dict({
        "drafter": d, "data": {"token_budget": length, "max_length": length,
                               "max_seqs_per_batch": 1},
        "layout": {"device": "cuda", "targets": [0], "drafters": [1], "hs_queue": 1}})


def test_recomputing_the_layers_makes_a_long_sample_smaller():
    s = model_shape(QWEN36_27B)
    for length in (8192, 32768, 131072):
        cfg = seed_drafter(length)
        kept = sum(drafter_components(cfg, s, QWEN36_27B, True, recompute=False).values())
        again = sum(drafter_components(cfg, s, QWEN36_27B, True, recompute=True).values())
        assert again < kept, length
    # what recompute keeps of the blocks: every layer's float32 input, and one layer rebuilt in
    # backward (9 H + 7 q + 11 kv + 4 I units), not eight
    cfg = seed_drafter(131072)
    kept = drafter_phases(cfg, s, QWEN36_27B, True, recompute=False)["backward"]
    again = drafter_phases(cfg, s, QWEN36_27B, True, recompute=True)["backward"]
    layer = 8192 * (9 * H + 7 * 24 * 256 + 11 * KV + 4 * 17408) * 2
    final = 8192 * (2 * H + 4 * 256) * 2  # the final states and RoPE of the blocks
    assert again["block activations"] == 8192 * 8 * 2 * H * 2 + final + layer
    assert kept["block activations"] == 8 * layer + final
    # and of the context one layer's keys, values and k_norm input (4 kv), not eight, and the
    # recompute's measured term (6 H per context token)
    assert again["context activations"] == 131072 * (4 * KV + 6 * H) * 2
    assert kept["context activations"] == 8 * 131072 * 4 * KV * 2


def test_each_phase_of_a_pass_is_named_and_the_row_is_the_one_that_peaks():
    s = model_shape(QWEN36_27B)
    cfg = seed_drafter(32768)
    phases = drafter_phases(cfg, s, QWEN36_27B, True, recompute=False)
    assert tuple(phases) == PHASES
    held = ("drafter fp32+adam", "autocast copies", "embed+lm_head", "received features",
            "context")
    for name, terms in phases.items():
        assert tuple(terms)[:5] == held, name  # held through the whole pass
    assert phases["loss"]["loss chunk"] == 4096 * V * 8
    assert "loss chunk" not in phases["backward"] and "layer backward" not in phases["loss"]
    # the context's float32 gradient, one projection's input gradient and its cast (5 H), the
    # attention's key and value gradients (2 kv); the residual and final states' gradients
    assert phases["backward"]["layer backward"] == (32768 * (5 * H + 2 * KV)
                                                    + 8192 * 4 * H) * 2
    # one sample a batch: the features received once (no next group to copy ahead)
    assert phases["loss"]["received features"] == 32768 * K * H * 2
    peak = peak_phase(phases)
    assert sum(phases[peak].values()) == max(sum(t.values()) for t in phases.values())
    plan = plan_memory(cfg, QWEN36_27B, {"cuda:1": CAP})
    assert plan.drafter_peak == peak
    tensors = {k: v for k, v in plan.row("cuda:1").components.items()
               if k not in ("cuda context", "allocator reserve")}
    assert tensors == {k: v for k, v in phases[peak].items() if v}
    # at 128k tokens with the layers recomputed, a layer's backward over the context outgrows
    # the loss chunk
    long_ = drafter_phases(seed_drafter(131072), s, QWEN36_27B, True, recompute=True)
    assert peak_phase(long_) == "backward"


def _check(monkeypatch, cfg, free=CAP):
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda d=None: (free, free))
    events = []
    check_memory(cfg, QWEN36_27B, [torch.device("cuda", 0)], [torch.device("cuda", 1)],
                 events.append)
    return events


def test_preflight_accepts_what_the_plan_fits_and_refuses_what_it_does_not(monkeypatch):
    # 32k tokens: every layer's activations kept fit the 96 GB card
    events = _check(monkeypatch, seed_drafter(32768))
    (plan,) = [e for e in events if isinstance(e, MemoryPlan)]
    assert plan.fits
    # 128k: kept, they do not (not even with the smallest loss chunk); recomputed, they do
    off = seed_drafter(131072, recompute="off")
    assert not plan_memory(off, QWEN36_27B, {"cuda:1": CAP}).fits
    with pytest.raises(ConfigError) as info:
        _check(monkeypatch, off)
    assert "drafter.recompute: on, or auto" in info.value.hint
    auto = seed_drafter(131072)
    planned = plan_memory(auto, QWEN36_27B, {"cuda:0": CAP, "cuda:1": CAP})
    assert planned.fits and planned.recompute
    events = _check(monkeypatch, auto)
    assert auto.drafter.recompute == "on"  # what the replicas read
    (said,) = [e.message for e in events if isinstance(e, Log) and "recompute auto -> on" in
               e.message]
    assert f"({planned.without_recompute / GiB:.1f} GiB planned)" in said
    # a million tokens fit nothing: refused, saying how long a sample can be
    with pytest.raises(ConfigError) as info:
        _check(monkeypatch, seed_drafter(1 << 20))
    longest = longest_sample(seed_drafter(1 << 20), QWEN36_27B, {"cuda:0": CAP, "cuda:1": CAP},
                             {"cuda:0": CAP, "cuda:1": CAP})
    assert 131072 <= longest < 1 << 20
    assert f"samples of up to {longest} tokens fit these GPUs" in info.value.hint
    # one sample a batch: for both GPUs the lever is the sample's length
    assert "(target) needs" in info.value.hint and "(drafter) needs" in info.value.hint
    assert info.value.key == "data.max_length"
    assert info.value.hint.count("lower data.max_length (now 1048576)") == 2


def test_the_longest_sample_is_where_the_plan_stops_fitting():
    both = {"cuda:0": CAP, "cuda:1": CAP}
    cfg = seed_drafter(8192)
    longest = longest_sample(cfg, QWEN36_27B, both, both)
    assert longest % STEP == 0 and longest >= 131072

    def fits(length, free=both):
        return fit_sizes(seed_drafter(length), QWEN36_27B, free, free) is not None
    assert fits(longest) and not fits(longest + STEP)
    # the target bounds it there; the drafter GPU alone takes longer samples, fewer without
    # recompute, fewer on a smaller card
    drafter = {"cuda:1": CAP}
    alone = longest_sample(cfg, QWEN36_27B, drafter, drafter)
    assert alone > longest and fits(alone, drafter) and not fits(alone + STEP, drafter)
    off = longest_sample(seed_drafter(8192, recompute="off"), QWEN36_27B, drafter, drafter)
    assert off < alone
    small = {"cuda:1": 80 * GiB}
    assert longest_sample(cfg, QWEN36_27B, small, small) < alone


def test_density_anchors_are_planned_at_the_longest_sample():
    # 15.625 anchors per 1k tokens: 2048 at 128k (cap 4096), in passes of 512 (8192 block tokens)
    dense = seed_drafter(131072, num_anchors=4096, anchors_per_1k_tokens=15.625)
    p = drafter_pass(dense)
    assert (p.blocks, p.pass_blocks, p.block_tokens) == (2048, 512, 8192)
    count = seed_drafter(131072)
    s = model_shape(QWEN36_27B)
    a = drafter_phases(dense, s, QWEN36_27B, True, recompute=True)
    b = drafter_phases(count, s, QWEN36_27B, True, recompute=True)
    assert a == b  # a pass holds as many blocks either way: more passes, not more memory
    # in one pass (micro_block_tokens 32768) its blocks would need 4x the activations
    whole = seed_drafter(131072, num_anchors=4096, anchors_per_1k_tokens=15.625,
                         micro_block_tokens=32768)
    assert drafter_pass(whole).block_tokens == 32768
    c = drafter_phases(whole, s, QWEN36_27B, True, recompute=True)
    assert c["backward"]["block activations"] == 4 * a["backward"]["block activations"]
    # a short sample gets few anchors: at 2k tokens, 32
    assert drafter_pass(seed_drafter(2048, num_anchors=4096,
                                     anchors_per_1k_tokens=15.625)).blocks == 32


def test_a_128k_sample_costs_the_target_its_features_and_attention():
    s = model_shape(QWEN36_27B)
    T = 131072
    one = seed_drafter(T)  # one sample a batch
    comps = target_components(one, s, QWEN36_27B, True, queued=1, quantized=True)
    assert comps["features"] == T * K * H * 2  # 6.25 GiB
    assert comps["hs queue"] == comps["features"]
    assert comps["attention mask"] == 0  # one row: SDPA runs causal without a mask
    several = seed_drafter(T)
    several.data.max_seqs_per_batch = 64
    multi = target_components(several, s, QWEN36_27B, True, queued=1, quantized=True)
    assert multi["attention mask"] == T * (T // 2)  # two rows of 64k at most: 8 GiB
    # a full-attention layer expands k/v to all 24 heads only with a padding mask: 22.25 GiB
    # with it (test_memory.py's 91136 values a token), 19.25 without, where the Gated DeltaNet
    # layer's 20.75 GiB is the largest
    assert multi["layer transient"] == T * 91136 * 2
    assert comps["layer transient"] == int(20.75 * GiB)
    # the whole 27B target with one 128k sample and one queued fits a 96 GB card
    plan = plan_memory(one, QWEN36_27B, {"cuda:0": CAP, "cuda:1": CAP})
    assert plan.row("cuda:0").fits and plan.row("cuda:0").total > 85 * GiB
