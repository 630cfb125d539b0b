"""Preflight memory plan: the real node's plan worked out by hand, and other layouts."""

from __future__ import annotations

import copy

import pytest
import torch

from dflash_core.config import config_from_dict
from dflash_core.planning.memory import CUDA_CONTEXT, cuda_margin, fit_sizes, plan_memory
from dflash_core.planning.memory_report import format_plan
from dflash_core.planning.weight_bytes import target_weight_bytes
from dflash_core.units import GiB

from ..models.target.test_model_shape import QWEN3_8B, QWEN36_27B


# --------------------------------------------------------------------------------------------
# Bytes
# --------------------------------------------------------------------------------------------

def test_target_weight_bytes():
    # the figure: ~50.1 GiB of bf16 weights
    assert target_weight_bytes(QWEN36_27B, "bfloat16") / GiB == pytest.approx(50.1, abs=0.05)
    assert target_weight_bytes(QWEN36_27B, torch.float32) == 4 * 26_895_998_464


# --------------------------------------------------------------------------------------------
# The real node: Qwen3.6-27B, targets on cuda:0..6, drafter on cuda:7, 96 GiB-class GPUs
# --------------------------------------------------------------------------------------------

# The keys of config.yaml that matter here, as DFlash (drafter: 8 layers, micro_block_tokens
# 65536; test_memory_dspark.py plans DSpark's). The torch loss's plan, worked out by hand below,
# wherever the tests run (auto would plan the fused loss's on a machine with Triton;
# test_memory_fused.py plans that one).
NODE = {"layout": {"device": "cuda", "targets": [0, 1, 2, 3, 4, 5, 6], "drafters": [7],
                   "hs_queue": 8},
        "data": {"token_budget": 65536, "max_length": 3072},
        "target": {"num_features": 5},
        "drafter": {"objective": "dflash", "num_layers": 8, "num_anchors": 512, "block_size": 16,
                    "loss_chunk": 4096, "micro_block_tokens": 65536, "fused_loss": "off"}}
GPU96 = {f"cuda:{i}": 96 * GiB for i in range(8)}
H200 = {f"cuda:{i}": 139 * GiB for i in range(8)}  # what torch reports free on an H200


def node(**drafter) -> object:
    d = copy.deepcopy(NODE)
    d["drafter"].update(drafter)
    return config_from_dict(d)


T, H, I, V, K = 65536, 5120, 17408, 248320, 5  # tokens, hidden, intermediate, vocab, features


def target_row_by_hand() -> dict[str, int]:
    weights = 26_895_998_464 * 2  # params x 2 bytes (bf16) = 50.1 GiB
    # residual, normed input / output, and the embeddings kept by the decoder: 3 x T x H x 2
    residual = 3 * T * H * 2  # = 1.875 GiB
    # Largest layer transient: a full-attention layer (24 heads x 256 = 6144 wide, gated q).
    # Per token: q_proj out with gate 12288 + normed and roped q 12288 + k/v expanded to 24 heads
    # 12288 + attention out 6144 + gated out 6144 + o_proj out 5120 + q_norm float32 upcast and
    # RoPE temporaries 6 x 6144 = 36864 -> 91136 elements x 2 bytes x 65536 tokens = 11.125 GiB.
    attention = T * (12288 + 12288 + 12288 + 6144 + 6144 + 5120 + 6 * 6144) * 2
    assert attention == int(11.125 * GiB)
    # (a Gated DeltaNet layer, conv_dim 10240, value_dim 6144, key_dim 2048:
    #  masked input + conv output + z = 65536 x (5120 + 10240 + 6144) x 2 = 2.625 GiB, then the
    #  kernel phase: contiguous q/k/v + l2-normed q, k + w + u, new v, output
    #  = 65536 x (10240 + 4096 + 6144 + 18432) x 2 = 4.75 GiB, float32 A and its inverse
    #  2 x 65536 x 48 x 64 x 4 = 1.5 GiB, one bf16 128 x 128 state per 64-token chunk per value
    #  head 1024 x 48 x 128 x 128 x 2 = 1.5 GiB -> 10.375 GiB in all;
    #  MLP: 3 x 65536 x 17408 x 2 = 6.375 GiB: both smaller)
    mask = T * 3072  # bool SDPA padding mask, sum of S^2 over sequences <= T x max_length
    features = T * K * H * 2  # = 3.125 GiB
    assert features == int(3.125 * GiB)
    hs_queue = 2 * features  # ceil(hs_queue 8 / 7 targets) = 2 queued batches per target
    tensors = {"weights": weights, "residual stream": residual, "layer transient": attention,
               "attention mask": mask, "features": features, "hs queue": hs_queue}
    return tensors | cuda_margin(sum(tensors.values()))


def drafter_row_by_hand(seqs_per_pass: int, layers: int = 8) -> dict[str, int]:
    """The drafter's row at its peak, the loss: every layer's activations saved and one chunk of
    the loss's logits (a layer's backward over 3072-token contexts holds far less)."""
    params = layers * 340_797_952 + 25600 * 5120 + 2 * 5120  # layers, fc, hidden_norm + norm
    block_tokens = seqs_per_pass * 512 * 16  # anchors x block size per sequence
    context_tokens = seqs_per_pass * 3072
    # saved per block token per layer, 2-byte units: 9 H + 7 q + 11 kv + 4 I = 169,984; once:
    # the final states (2 H) and RoPE's cos / sin (4 x head_dim 256)
    saved = 9 * H + 7 * 24 * 256 + 11 * 4 * 256 + 4 * I
    # per context token once: hidden_norm's float32 input and the shared bf16 copy (3 H), RoPE;
    # per layer: k_norm's float32 input and the attention's keys and values (4 kv)
    tensors = {
        "drafter fp32+adam": params * 16,  # 42.6 GiB for 8 layers
        "autocast copies": params * 2,  # 5.3 GiB
        "embed+lm_head": 2 * V * H * 2,  # 4.7 GiB, frozen bf16, untied
        # two micro-groups' features (one computing, the next arriving): 3072 x 25600 x 2 =
        # 0.15 GiB per sequence, twice
        "received features": 2 * context_tokens * K * H * 2,
        "context": context_tokens * (3 * H + 4 * 256) * 2,  # 0.09 GiB per sequence
        "block activations": block_tokens * (layers * saved + 2 * H + 4 * 256) * 2,  # 20.9
        "context activations": context_tokens * layers * 4 * 4 * 256 * 2,  # 0.19 per sequence
        "loss chunk": 4096 * V * 8,  # 7.6 GiB
    }
    return tensors | cuda_margin(sum(tensors.values()))


def test_real_node_target_row_by_hand_fits_96gib():
    plan = plan_memory(node(), QWEN36_27B, GPU96, GPU96)
    assert [r.device for r in plan.rows] == [f"cuda:{i}" for i in range(8)]
    expected = target_row_by_hand()
    for i in range(7):
        row = plan.row(f"cuda:{i}")
        assert row.role == "target"
        assert row.components == expected
    # tensors 50.10 + 1.875 + 11.125 + 0.19 + 3.125 + 6.25 = 72.66, + context 2 + reserve 4%
    # 2.91 = 77.57 GiB of 96
    assert plan.row("cuda:0").total / GiB == pytest.approx(77.57, abs=0.01)
    assert plan.row("cuda:0").fits


def test_full_logits_would_overflow_the_target_as_in_the_real_launch():
    plan = plan_memory(node(micro_block_tokens=8192), QWEN36_27B, GPU96, GPU96)
    logits = T * V * 2  # 65536 x 248320 x 2 bytes = 30.3 GiB
    assert logits / GiB == pytest.approx(30.31, abs=0.01)
    assert plan.logits_extra == logits
    assert plan.logits_upcast_extra == 2 * logits  # HF's float32 upcast in the loss path
    row = plan.row("cuda:0")
    assert "logits" not in row.components  # the engine never computes them
    # 77.57 + 30.31 = 107.88 GiB > 96 GiB free: out of memory, as on the real node
    assert (row.total + plan.logits_extra) / GiB == pytest.approx(107.88, abs=0.01)
    assert row.fits and plan.fits
    assert "full target logits would add 30.3 GiB per target GPU" in format_plan(plan)


def test_overflowing_targets_are_named_once_with_the_key_to_lower():
    gpu64 = {f"cuda:{i}": 64 * GiB for i in range(8)}
    plan = plan_memory(node(micro_block_tokens=8192), QWEN36_27B, gpu64, gpu64)
    assert not plan.row("cuda:0").fits and not plan.fits
    assert plan.overflows[0].devices == [f"cuda:{i}" for i in range(7)]
    assert plan.key == "data.token_budget"
    text = format_plan(plan)
    assert "cuda:0..6 (target) needs 77.6 GiB but has 64.0 GiB free" in text
    assert "data.token_budget (now 65536)" in text


def test_drafter_of_config_yaml_does_not_fit_and_names_the_key():
    # micro_block_tokens 65536 / (512 anchors x 16) = 8 of the 21 sequences per forward/backward
    plan = plan_memory(node(), QWEN36_27B, H200, H200)
    row = plan.row("cuda:7")
    assert row.role == "drafter"
    assert row.components == drafter_row_by_hand(seqs_per_pass=8)
    # tensors 42.58 + 5.32 + 4.74 + 2.34 + 0.75 + 167.4 + 1.5 + 7.58 = 232.2, + 2 + 4% = 243.5
    assert row.components["block activations"] / GiB == pytest.approx(167.38, abs=0.01)
    assert row.total / GiB == pytest.approx(243.47, abs=0.01)
    assert not row.fits and not plan.fits
    # fewer sequences a pass would fit, so drafter.recompute auto stays off
    assert not plan.recompute and plan.drafter_peak == "loss"
    (overflow,) = plan.overflows
    assert overflow.devices == ["cuda:7"] and overflow.row is row
    assert overflow.lower[0] == ("drafter.micro_block_tokens", 65536)
    assert plan.key == "drafter.micro_block_tokens"
    text = format_plan(plan)
    assert "plan does NOT fit" in text
    assert ("cuda:7 (drafter) needs 243.5 GiB but has 139.0 GiB free: "
            "lower drafter.micro_block_tokens (now 65536)") in text


def test_drafter_with_smaller_micro_batches_fits():
    # two sequences per pass on an H200: tensors 42.58 + 5.32 + 4.74 + 0.59 + 0.19 + 41.84 +
    # 0.38 + 7.58 = 103.2, + 2 + 4% = 109.3
    plan = plan_memory(node(micro_block_tokens=16384), QWEN36_27B, H200, H200)
    row = plan.row("cuda:7")
    assert row.components == drafter_row_by_hand(seqs_per_pass=2)
    assert row.total / GiB == pytest.approx(109.34, abs=0.01)
    assert plan.fits and plan.overflows == [] and plan.key is None
    assert format_plan(plan).rstrip().endswith("plan fits")
    # one sequence per pass fits a 96 GiB card: tensors 42.58 + 5.32 + 4.74 + 0.29 + 0.09 +
    # 20.92 + 0.19 + 7.58 = 81.71, + 2 + 4% = 86.98 GiB
    small = plan_memory(node(micro_block_tokens=8192), QWEN36_27B, GPU96, GPU96)
    assert small.row("cuda:7").components == drafter_row_by_hand(seqs_per_pass=1)
    assert small.row("cuda:7").total / GiB == pytest.approx(86.98, abs=0.01)
    assert small.fits and not small.recompute


def test_a_sequence_too_big_for_the_card_recomputes_its_layers_or_names_the_levers():
    gpu80 = {f"cuda:{i}": 80 * GiB for i in range(8)}
    # one whole sequence needs 87.0 GiB kept, 79.5 with the smallest loss chunk (256): a smaller
    # chunk would do, so auto does not recompute and the plan names the chunk
    chunked = plan_memory(node(micro_block_tokens=8192), QWEN36_27B, gpu80, gpu80)
    assert not chunked.recompute and not chunked.fits
    assert "drafter.loss_chunk (now 4096)" in format_plan(chunked)
    # on a 76 GiB drafter card not even that fits: auto recomputes the layers, and it fits
    gpu76 = {f"cuda:{i}": (96 if i < 7 else 76) * GiB for i in range(8)}
    auto = plan_memory(node(micro_block_tokens=8192), QWEN36_27B, gpu76, gpu76)
    assert auto.recompute and auto.fits
    assert auto.without_recompute == pytest.approx(86.98 * GiB, rel=1e-4)
    table = format_plan(auto)
    assert any(line.split()[:2] == ["drafter", "layers"] and line.split()[-1] == "recomputed"
               for line in table.splitlines())
    assert any(line.split()[:3] == ["total", "if", "kept"] and line.split()[-1] == "87.0"
               for line in table.splitlines())
    # off: its anchors can still go in smaller passes, and recomputing would help: both named
    off = node(micro_block_tokens=8192, recompute="off")
    tight = plan_memory(off, QWEN36_27B, gpu80, gpu80)
    assert not tight.fits and not tight.recompute
    text = format_plan(tight)
    assert "drafter.micro_block_tokens (now 8192)" in text
    assert "drafter.recompute: on, or auto" in text
    # at the smallest pass (64 anchors of 16) the anchors per sequence are the lever left
    smallest = plan_memory(node(micro_block_tokens=1024, recompute="off"), QWEN36_27B,
                           {"cuda:7": 60 * GiB}, {"cuda:7": 60 * GiB})
    assert "drafter.num_anchors (now 512)" in format_plan(smallest)


# --------------------------------------------------------------------------------------------
# Other layouts
# --------------------------------------------------------------------------------------------

def test_shared_device_sums_both_roles():
    shared = config_from_dict({"layout": {"device": "cuda", "targets": [0], "drafters": [0]},
                               "drafter": {"num_anchors": 64}})
    split = config_from_dict({"layout": {"device": "cuda", "targets": [0], "drafters": [1]},
                              "drafter": {"num_anchors": 64}})
    one = plan_memory(shared, QWEN3_8B, {"cuda:0": 141 * GiB})
    two = plan_memory(split, QWEN3_8B)
    assert [r.role for r in one.rows] == ["target+drafter"]
    row = one.rows[0]
    # one CUDA context, and the allocator reserve of the two roles' tensors together
    tensors = lambda r: r.total - r.components["cuda context"] - r.components["allocator reserve"]  # noqa: E731
    assert tensors(row) == tensors(two.row("cuda:0")) + tensors(two.row("cuda:1"))
    assert row.components["cuda context"] == CUDA_CONTEXT
    assert row.free == 141 * GiB
    # unknown free memory is not checked
    assert two.fits and two.row("cuda:1").free is None
    if not row.fits:
        assert "put targets and drafters on different GPUs" in format_plan(one)


def test_cpu_layout_has_one_row_without_cuda_overhead():
    cfg = config_from_dict({"layout": {"device": "cpu", "targets": [0, 1], "drafters": [0]},
                            "drafter": {"num_anchors": 8}, "data": {"token_budget": 4096}})
    plan = plan_memory(cfg, QWEN3_8B, {"cpu": 10 * GiB})
    (row,) = plan.rows
    assert row.device == "cpu" and row.role == "target+drafter"
    assert "cuda context" not in row.components and "allocator reserve" not in row.components
    assert "autocast copies" not in row.components
    assert row.components["weights"] == 2 * 8_190_735_360 * 4  # float32, one copy per worker
    assert not plan.fits
    text = format_plan(plan)
    assert "data.token_budget (now 4096)" in text and "use devices with more memory" in text
    assert "different GPUs" not in text


# --------------------------------------------------------------------------------------------
# Sizes that fit
# --------------------------------------------------------------------------------------------

def test_fit_sizes_lowers_the_drafter_micro_group_to_what_fits():
    assert fit_sizes(node(micro_block_tokens=8192), QWEN36_27B, GPU96, GPU96) == {}
    # 65536 (8 sequences, 243.5 GiB) -> 32768 -> 16384 (109.3 GiB) -> 8192 (87.0 GiB <= 96)
    sizes = fit_sizes(node(micro_block_tokens=65536), QWEN36_27B, GPU96, GPU96)
    assert sizes == {"drafter.micro_block_tokens": 8192}
    # an 86 GiB card needs the loss chunk lower too (87.0 - 86 = 1.0 GiB; half the chunk saves
    # 3.8 GiB + its reserve), not the layers recomputed: a whole sequence fits without
    gpu86 = {f"cuda:{i}": 86 * GiB for i in range(8)}
    sizes = fit_sizes(node(micro_block_tokens=65536), QWEN36_27B, gpu86, gpu86)
    assert sizes == {"drafter.micro_block_tokens": 8192, "drafter.loss_chunk": 2048}
    cfg = node(micro_block_tokens=65536)
    cfg.drafter.micro_block_tokens, cfg.drafter.loss_chunk = 8192, 2048
    assert plan_memory(cfg, QWEN36_27B, gpu86, gpu86).fits


def test_fit_sizes_lowers_the_target_queue_then_the_budget():
    gpu52 = {f"cuda:{i}": 52 * GiB for i in range(8)}  # targets need 77.6 GiB
    sizes = fit_sizes(node(micro_block_tokens=8192), QWEN36_27B, gpu52, gpu52)
    assert sizes is None  # the drafter's 52.6 GiB of weights alone do not fit 52 GiB
    gpu = {f"cuda:{i}": (64 if i < 7 else 96) * GiB for i in range(8)}
    sizes = fit_sizes(node(micro_block_tokens=8192), QWEN36_27B, gpu, gpu)
    # hs_queue 8 -> 1 (one queued batch per target), then the budget: at 32768 the targets need
    # 50.1 + 9.7 transient + 2 + 4% = 64.3 GiB, at 16384 59.1 GiB
    assert sizes == {"layout.hs_queue": 1, "data.token_budget": 16384}


def test_muon_state_is_one_momentum_per_matrix_entry_and_two_moments_for_the_norms():
    cfg = node(micro_block_tokens=8192)
    cfg.optim.name = "muon"
    row = plan_memory(cfg, QWEN36_27B, GPU96, GPU96).row("cuda:7")
    by_hand = drafter_row_by_hand(seqs_per_pass=1)
    params = by_hand.pop("drafter fp32+adam") // 16
    # per layer: the Qwen3 norms (2 x 5120) and q_norm / k_norm (2 x head_dim 256); then
    # hidden_norm and norm. Everything else is a matrix: weight 4 + grad 4 + momentum 4 bytes.
    norms = 8 * (2 * 5120 + 2 * 256) + 2 * 5120
    muon = (params - norms) * 12 + norms * 16  # 32.0 GiB where AdamW needs 42.6
    tensors = {"drafter fp32+muon": muon, **by_hand}
    del tensors["cuda context"], tensors["allocator reserve"]
    assert row.components == tensors | cuda_margin(sum(tensors.values()))
    assert row.total < plan_memory(node(micro_block_tokens=8192), QWEN36_27B, GPU96,
                                   GPU96).row("cuda:7").total
