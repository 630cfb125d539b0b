"""bench/training/drafter_step.py: its arguments, the FLOPs DSpark's loss and DFlash2's
convolutions and selector add, and tiny-shape runs on the CPU with --objective dspark and dflash2
(the GPU run measures the real shapes; this checks that the script runs through the engine's
trainer and prints the step time next to the plan)."""

import re
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "bench" / "training"))

from drafter_step import SHAPES, main, parse_args, run_config, size, step_flops  # noqa: E402

from dflash_core.families.dflash2 import DFlash2Settings  # noqa: E402
from dflash_core.families.registry import settings as family_settings  # noqa: E402
from dflash_core.planning.memory import plan_memory  # noqa: E402

TINY = ["--device", "cpu", "--shapes", "tiny", "--seq-len", "48", "--anchors", "4",
        "--samples", "2", "--layers", "1"]


def test_dspark_takes_the_configs_dspark_defaults_and_the_flags_override_them():
    args = parse_args([*TINY, "--objective", "dspark"])
    assert (args.block_size, args.loss_chunk, args.markov_rank) == (7, 1024, 256)
    args = parse_args([*TINY, "--objective", "dspark", "--block-size", "5", "--loss-chunk",
                       "64", "--markov-rank", "32"])
    assert (args.block_size, args.loss_chunk, args.markov_rank) == (5, 64, 32)
    cfg = run_config(args, 96)
    assert (cfg.drafter.objective, cfg.drafter.block_size, cfg.drafter.markov_rank) == (
        "dspark", 5, 32)
    args = parse_args(TINY)  # DFlash keeps this figure's own block 16 and chunk 8192
    assert (args.objective, args.block_size, args.loss_chunk) == ("dflash", 16, 8192)


def test_dflash2_takes_the_configs_dflash2_defaults_and_passes_its_keys_to_the_engine():
    args = parse_args([*TINY, "--objective", "dflash2"])  # block 8, the key's own chunk 4096
    assert (args.block_size, args.loss_chunk) == (8, 4096)
    assert family_settings(run_config(args, 96)) == DFlash2Settings()  # the family's defaults
    args = parse_args([*TINY, "--objective", "dflash2", "--block-size", "6", "--loss-chunk",
                       "64", "--conv-kernel-size", "3", "--conv-group-size", "8",
                       "--selector-rank", "32", "--selector-top-k", "4"])
    cfg = run_config(args, 96)
    assert cfg.drafter.objective == "dflash2"
    assert (cfg.drafter.block_size, cfg.drafter.loss_chunk) == (6, 64)
    assert family_settings(cfg) == DFlash2Settings(
        block_size=6, conv_kernel_size=3, conv_group_size=8, selector_rank=32, selector_top_k=4)


@pytest.mark.parametrize("argv, says", [
    (["--markov-rank", "64"], "--markov-rank is DSpark's"),
    (["--objective", "dspark", "--loss", "dpace"], "drafter.loss: dpace does not combine"),
    (["--objective", "dspark", "--markov-rank", "0"], "drafter.markov_rank"),
    (["--objective", "dspark", "--markov-rank", "1000"], "exceeds the target's vocabulary"),
    (["--shapes", "70B"], "unknown ['70B']"),
    (["--steps", "0"], "--steps must be >= 1"),
    (["--time-loss", "--batches", "2x64"], "give one of them"),
    (["--batches", "2x64,4y32"], "expected ROWSxLENGTH"),
    (["--fused-loss", "on"], "--fused-loss on: on needs the drafters on CUDA GPUs"),
    (["--fused-loss", "fast"], "invalid choice: 'fast'"),
    (["--selector-top-k", "4"], "--selector-top-k is DFlash2's: add --objective dflash2"),
    (["--objective", "dspark", "--conv-group-size", "8"], "--conv-group-size is DFlash2's"),
    (["--objective", "dflash2", "--markov-rank", "64"], "--markov-rank is DSpark's"),
    (["--objective", "dflash2", "--loss", "dpace"], "drafter.loss: dpace does not combine"),
    (["--objective", "dflash2", "--fused-loss", "on"],
     "--fused-loss on: on needs the drafters on CUDA GPUs"),
    (["--objective", "dflash2", "--conv-group-size", "48"], "must divide the drafter's width 64"),
    (["--objective", "dflash2", "--selector-top-k", "1000"], "exceeds the target's vocabulary"),
])
def test_bad_arguments_exit_2_naming_the_cause(argv, says, capsys):
    with pytest.raises(SystemExit) as exc_info:
        parse_args([*TINY, *argv])
    assert exc_info.value.code == 2
    assert says in capsys.readouterr().err


def test_cuda_without_a_gpu_points_at_the_cpu_smoke_run(capsys, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit):
        parse_args(["--shapes", "8B"])
    assert "--device cpu --shapes tiny" in capsys.readouterr().err


def test_dsparks_flop_count_adds_its_losss_matmuls():
    dc = SimpleNamespace(hidden_size=4096, head_dim=128, num_attention_heads=32,
                         num_key_value_heads=8, num_hidden_layers=5, intermediate_size=12288)
    n, S, A, B, V, r, H = 8, 3072, 512, 7, 151936, 256, 4096
    dflash = step_flops(dc, n, S, A, B, V)
    dspark = step_flops(dc, n, S, A, B, V, objective="dspark", rank=r)
    assert set(dflash) == {"drafter", "lm_head"}
    assert dspark["drafter"] == dflash["drafter"]
    rows = A * B  # every DSpark slot predicts; DFlash's anchor slot does not
    assert dspark["lm_head"] == pytest.approx(dflash["lm_head"] * B / (B - 1))
    assert dspark["target lm_head"] == pytest.approx(n * 2 * rows * H * V)  # forward only
    assert dspark["markov head"] == pytest.approx(3 * n * 2 * rows * r * V)
    assert dspark["confidence head"] == pytest.approx(3 * n * 2 * rows * (H + r))
    no_conf = step_flops(dc, n, S, A, B, V, objective="dspark", rank=r, confidence=False)
    assert "confidence head" not in no_conf


def test_dflash2s_flop_count_adds_its_convolutions_and_selector_by_hand():
    # a small drafter: H 64, 2 layers; n 2 samples of S 96, A 4 anchors of B 8 (32 tokens)
    dc = SimpleNamespace(hidden_size=64, head_dim=16, num_attention_heads=4,
                         num_key_value_heads=2, num_hidden_layers=2, intermediate_size=128)
    n, S, A, B, V = 2, 96, 4, 8, 1000
    dflash = step_flops(dc, n, S, A, B, V)
    s = DFlash2Settings(block_size=B, conv_kernel_size=3, conv_group_size=16, selector_rank=8,
                        selector_top_k=4)
    d2 = step_flops(dc, n, S, A, B, V, objective="dflash2", settings=s)
    assert set(d2) == {"drafter", "lm_head", "convolutions", "selector"}
    assert (d2["drafter"], d2["lm_head"]) == (dflash["drafter"], dflash["lm_head"])  # B-1 of B
    # per block token and layer: 2 projections 64 -> 2*3*4 = 24 (M = 64/16 = 4 groups), 2*64*24
    # each; per block, 4 convolutions of 3 taps over 8, 7, 6 positions: 2 (beta + Delta, the
    # product) x 21 + the running sums 7 + 6 = 55 per channel, 55*64 each
    per_token, per_block = 2 * 2 * 64 * 24, 4 * 55 * 64  # 6144, 14080
    assert d2["convolutions"] == 3 * n * 2 * (A * B * per_token + A * per_block)
    assert d2["convolutions"] == 3 * 2 * 2 * (32 * 6144 + 4 * 14080)
    # per labelled slot (28 of the 32: B-1 of B): gate 2*64*8, A[a] x gate 8, the pair term over
    # K 4 candidates 2*8*4 (K r = 32 below V), U + pair 4
    assert d2["selector"] == 3 * n * 28 * (1024 + 8 + 64 + 4)
    # K r above the vocabulary: the loss takes the product over all V codebook rows, 2*r*V
    small = step_flops(dc, n, S, A, B, 16, objective="dflash2", settings=s)
    assert small["selector"] == 3 * n * 28 * (1024 + 8 + 2 * 8 * 16 + 4)
    # a block shorter than the kernel: the taps stop at the block (B 2: 2 taps over 2 and 1
    # positions: 2 x 3 + 1 = 7 per channel)
    short = step_flops(dc, n, S, A, 2, V, objective="dflash2", settings=s)
    assert short["convolutions"] == 3 * n * 2 * (A * 2 * 2 * 2 * 64 * 24 + A * 4 * 7 * 64)
    # no settings: the family's defaults (T 2, G 16, r 256, K 16) at B
    assert step_flops(dc, n, S, A, B, V, objective="dflash2") == step_flops(
        dc, n, S, A, B, V, objective="dflash2", settings=DFlash2Settings(block_size=B))


def test_dflash2s_flop_count_is_what_its_model_code_computes():
    """The count against the code it describes: torch's FLOP counter on the drafter's forward
    (DFlash2's less DFlash's: the kernel projections) and on DFlash2's loss in both of its ways
    to the pair term (less the lm_head), and the convolution's element-wise products and sums."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils.flop_counter import FlopCounterMode
    from transformers import Qwen3Config

    from dflash_core.models.dflash2.conv import BlockConv
    from dflash_core.models.dflash2.loss import dflash2_loss, predecessors
    from dflash_core.models.objective import block_labels, label_rows
    from dflash_core.models.registry import new_drafter

    H, V, L, n, S, A, B = 64, 512, 1, 2, 48, 3, 8
    s = DFlash2Settings(block_size=B, conv_kernel_size=3, conv_group_size=16)
    tc = Qwen3Config(vocab_size=V, hidden_size=H, intermediate_size=128, num_hidden_layers=4,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, V - 1, (n, S), generator=g)
    anchors = torch.sort(torch.randint(0, S - B, (n, A), generator=g), -1).values
    feats = torch.randn(n, S, 3 * H, generator=g)
    forward, drafters = {}, {}
    for objective in ("dflash", "dflash2"):
        d = new_drafter(objective, tc, num_layers=L, target_layer_ids=[0, 1, 2], block_size=B,
                        mask_token_id=V - 1, settings=s if objective == "dflash2" else None)
        d.attach_target_head(torch.nn.Embedding(V, H), torch.nn.Linear(H, V, bias=False))
        d.attn_impl = "chunked"
        bids, pos = d.block_inputs(ids, anchors)
        with torch.no_grad(), FlopCounterMode(display=False) as fc:
            hidden = d(feats, d.embed_tokens(bids), pos, anchors)
        forward[objective], drafters[objective] = fc.get_total_flops(), (d, hidden)
    dc = SimpleNamespace(hidden_size=H, head_dim=16, num_attention_heads=4,
                         num_key_value_heads=2, num_hidden_layers=L, intermediate_size=128)
    T = A * B
    taps = s.conv_kernel_size
    reach = [B - t for t in range(taps)]  # per block, the positions each tap reaches
    elementwise = 4 * H * (2 * sum(reach) + sum(reach[1:]))  # per block and layer, counted below

    class Products(TorchDispatchMode):  # the products and sums a convolution computes
        count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func.overloadpacket in (torch.ops.aten.mul, torch.ops.aten.add,
                                       torch.ops.aten.add_):
                Products.count += out.numel()
            return out

    conv, x = BlockConv(H, taps, 16), torch.randn(n, T, H, generator=g)
    delta = conv.coefficients(x)
    with torch.no_grad(), Products():
        conv(x, delta, 0, B)
    assert Products.count * 4 == n * A * elementwise  # four convolutions a layer
    parts = step_flops(dc, n, S, A, B, V, objective="dflash2", settings=s)
    assert parts["convolutions"] / 3 == forward["dflash2"] - forward["dflash"] + (
        n * L * A * elementwise)
    d, hidden = drafters["dflash2"]
    labels = block_labels(ids, torch.ones_like(ids), anchors, B)
    prev, picked = predecessors(ids, anchors, B), label_rows(labels, 4.0)
    rows = len(picked.rows)
    for K in (16, 1):  # K r = 4096 above V 512 (the product over it), 256 below (K rows)
        d.selector_top_k = K
        with torch.no_grad(), FlopCounterMode(display=False) as fc:
            dflash2_loss(hidden, labels, prev, d, gamma=4.0, alpha=1.0, inject=False,
                         rows=picked)
        matmuls = fc.get_total_flops() - 2 * rows * H * V  # less the lm_head
        per_row = step_flops(dc, n, S, A, B, V, objective="dflash2", settings=DFlash2Settings(
            block_size=B, selector_top_k=K))["selector"] / (3 * n * A * (B - 1))
        assert per_row - (s.selector_rank + K) == matmuls / rows  # less A[a] x gate, U + pair


def test_a_tiny_dflash2_run_on_the_cpu_prints_its_terms_and_flops(capsys):
    main([*TINY, "--objective", "dflash2", "--steps", "1", "--warmup", "1"])
    out = capsys.readouterr().out
    steps = re.findall(r"tiny step (\d): ([0-9.]+) s, loss ([0-9.]+) \(ce ([0-9.]+), sel "
                       r"([0-9.]+), hit ([0-9.]+)\)", out)
    assert [s[0] for s in steps] == ["0", "1"]
    assert all(float(s[2]) > 0 and float(s[3]) > 0 for s in steps)
    row = next(x for x in out.splitlines() if x.startswith(
        "| tiny-shaped drafter, dflash2 (B 8, conv 2 taps x groups of 16, selector rank 256 "
        "top-16), adamw, torch loss"))
    assert "| step " in row and "samples/s" in row
    flops = re.search(r"FLOPs per step [0-9.e-]+ TFLOP \(drafter .*lm_head .*convolutions "
                      r"([0-9.e-]+), selector ([0-9.e-]+);", out)
    assert flops and float(flops.group(1)) > 0 and float(flops.group(2)) > 0


def test_time_loss_sets_dflash2s_loss_against_dflashs_ce_over_the_same_rows(capsys):
    main([*TINY, "--objective", "dflash2", "--time-loss", "--steps", "1", "--warmup", "0"])
    out = capsys.readouterr().out
    rows = {}
    for name in ("DFlash2 CE+selector", "DFlash chunked CE, same rows"):
        cells = [c.strip() for c in next(x for x in out.splitlines()
                                         if x.startswith(f"| {name} |")).split("|")[1:-1]]
        rows[name] = int(cells[1])
        assert cells[2] == "4096" and float(cells[3]) > 0
        assert cells[-1] == "torch"  # DFlash2 has no fused loss: both sides torch
    assert rows["DFlash2 CE+selector"] == rows["DFlash chunked CE, same rows"] > 0
    assert re.search(r"DFlash2's loss costs [0-9.]+x DFlash's chunked CE", out)


def test_a_tiny_dspark_run_on_the_cpu_prints_the_step_time_and_the_plan(capsys):
    argv = [*TINY, "--objective", "dspark", "--steps", "1", "--warmup", "1"]
    main(argv)
    out = capsys.readouterr().out
    steps = re.findall(r"tiny step (\d): ([0-9.]+) s, loss ([0-9.]+) \(ce ([0-9.]+), tv "
                       r"([0-9.]+), conf ([0-9.]+)\)", out)
    assert [s[0] for s in steps] == ["0", "1"]
    assert all(float(x) > 0 for s in steps for x in s[2:])  # DSpark's three terms, trained
    row = next(x for x in out.splitlines() if x.startswith("| tiny-shaped drafter, dspark (B 7, "
                                                           "Markov rank 256), adamw, torch loss"))
    step = float(re.search(r"\| step ([0-9.]+) s, of it optimizer", row).group(1))
    assert step == pytest.approx(float(steps[1][1]), abs=0.006)  # the timed step, unrounded
    # 2 samples in the step; the row prints the step rounded to its 3 decimals at most, so the
    # rate lies between what the rounded step's ends give
    rate = float(re.search(r"\| ([0-9.]+) samples/s", row).group(1))
    decimals = len(re.search(r"\| step [0-9]+\.?([0-9]*) s", row).group(1))
    half = 0.5 * 10 ** -decimals
    assert 2 / (step + half) * 0.99 <= rate <= 2 / max(step - half, 1e-9) * 1.01
    # the plan printed is the drafter GPU's plan of this very config (DSpark's loss chunk in it)
    args = parse_args(argv)
    plan = {r.device: r for r in plan_memory(run_config(args, 2 * 48), SHAPES["tiny"]).rows}
    assert f"| plan {size(plan['cuda:0'].total)} (tensors " in row
    assert f"of it loss chunk {size(plan['cuda:0'].components['loss chunk'])}" in out
    assert re.search(r"FLOPs per step [0-9.e-]+ TFLOP \(drafter .*target lm_head .*markov "
                     r"head .*confidence head", out)


def test_time_loss_sets_dsparks_loss_against_dflashs_ce_over_the_same_rows(capsys):
    main([*TINY, "--objective", "dspark", "--time-loss", "--steps", "1", "--warmup", "1"])
    out = capsys.readouterr().out
    rows = {}
    for name in ("DSpark CE+TV+conf", "DFlash chunked CE, same rows"):
        cells = [c.strip() for c in next(x for x in out.splitlines()
                                         if x.startswith(f"| {name} |")).split("|")[1:-1]]
        rows[name] = int(cells[1]), float(cells[3])
        assert cells[2] == "1024" and float(cells[3]) > 0
        assert cells[-1] == "torch"  # --fused-loss auto on the CPU: the torch loss
    dspark, dflash = rows.values()
    assert dspark[0] == dflash[0] > 0  # the same labelled slots
    ratio = float(re.search(r"DSpark's loss costs ([0-9.]+)x DFlash's chunked CE", out).group(1))
    assert ratio == pytest.approx(dspark[1] / dflash[1], rel=0.05)
