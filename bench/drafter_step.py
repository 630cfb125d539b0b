"""Figure 2: drafter optimizer steps through the engine's trainer (block-sparse FlexAttention,
chunked loss), 8B- and 27B-shaped, 3072-token samples, 512 anchors, block 16.

    python bench/drafter_step.py [--samples 8] [--steps 6]
    # config.yaml's drafter (8 layers, one sequence per micro-group, loss chunk 4096), 27B shape:
    python bench/drafter_step.py --shapes 27B --layers 8 --micro 8192 --loss-chunk 4096 --samples 4
    # what token-budget batches of different lengths cost the drafter (data.balance_steps):
    python bench/drafter_step.py --shapes 8B --batches 64x256,32x512,16x1024,8x2048,5x3072
    # the training recipe (drafter.loss, optim.name): step time and peak memory of each
    python bench/drafter_step.py --shapes 8B --loss dpace --optim muon
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import sys
import time

import torch

from common import (FIXTURES, H200_BF16_PEAK, decoder_flops_per_token, env_line, gib, hf_config,
                    use_transformers_norm)
from dflash_core.config import config_from_dict
from dflash_core.data import Batch
from dflash_core.models.drafter import DFlashDrafter, build_drafter_config
from dflash_core.planning.memory import plan_memory
from dflash_core.models.trainer import make_replicas, reduce_and_step

SHAPES = {"8B": ("qwen3_8b_config.json",), "27B": ("qwen3_6_27b_config.json",)}


def step_flops(dc, n, S, A, B, vocab, k=5):
    """Model FLOPs of one step (forward x 3), counting only unmasked attention."""
    H = dc.hidden_size
    hd, heads, kvh = dc.head_dim, dc.num_attention_heads, dc.num_key_value_heads
    T = A * B
    per_layer_ctx = 2 * S * H * 2 * kvh * hd  # k/v of the context
    dense = decoder_flops_per_token(dc, dc.num_hidden_layers) * T + per_layer_ctx * dc.num_hidden_layers
    attn = dc.num_hidden_layers * 2 * 2 * T * (S / 2 + B) * heads * hd
    fc = 2 * S * k * H * H
    head = 2 * T * (B - 1) / B * H * vocab
    return 3 * n * (dense + attn + fc + head)


def batch_of(n, S, vocab):
    ids = torch.randint(0, vocab - 1, (n, S))
    mask = torch.ones(n, S, dtype=torch.long)
    mask[:, :min(256, S // 4)] = 0  # a prompt
    return Batch(input_ids=ids, loss_mask=mask, attention_mask=torch.ones_like(mask),
                 lengths=torch.full((n,), S), indices=list(range(n)), epoch=0, batch_index=0,
                 num_tokens=n * S, padded_tokens=n * S, padding_frac=0.0)


def batch_costs(rep, spec: str, tc, anchors: int, stacks_after: float) -> None:
    """One step per batch shape (after two warm-up steps of that shape): its time against the
    drafter cost the batch planner balances (rows x min(anchors, length))."""
    print("| batch | tokens | rows x min(anchors, length) | s / step | ms per 1k block positions |")
    print("|---|---|---|---|---|")
    for item in spec.split(","):
        n, S = (int(x) for x in item.lower().split("x"))
        batch = batch_of(n, S, tc.vocab_size)
        feats = torch.randn(n, S, 5 * tc.hidden_size, device="cuda", dtype=torch.bfloat16)
        times = []
        for s in range(5):
            faulthandler.dump_traceback_later(stacks_after, repeat=True, file=sys.stdout)
            torch.cuda.synchronize()
            t = time.perf_counter()
            rep.accumulate(batch, feats, seed=s)
            reduce_and_step([rep], s, 1000)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t)
            faulthandler.cancel_dump_traceback_later()
        dt = sum(times[2:]) / 3
        cost = n * min(anchors, S)
        print(f"| {n} x {S} | {n * S} | {cost} | {dt:.3f} | {dt / cost * 1e6:.2f} |", flush=True)
        del feats


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--shapes", default="8B,27B", help="one per call keeps each under a limit")
    ap.add_argument("--micro", type=int, default=16384,
                    help="drafter.micro_block_tokens: block tokens live at once (memory)")
    ap.add_argument("--layers", type=int, default=5, help="drafter.num_layers")
    ap.add_argument("--loss-chunk", type=int, default=8192, help="drafter.loss_chunk")
    ap.add_argument("--loss", choices=("dflash", "dpace"), default="dflash", help="drafter.loss")
    ap.add_argument("--optim", choices=("adamw", "muon"), default="adamw", help="optim.name")
    ap.add_argument("--hf-norm", action="store_true",
                    help="transformers' eager Qwen3RMSNorm instead of the fused one (before/after)")
    ap.add_argument("--batches", default="",
                    help="ROWSxLENGTH,...: time one step of each batch shape instead (16384 "
                         "tokens as 64x256 .. 5x3072), against rows x min(anchors, length)")
    ap.add_argument("--stacks-after", type=float, default=240,
                    help="print every thread's stack if a step takes longer than this (s)")
    args = ap.parse_args()
    print(env_line())
    if args.hf_norm:
        use_transformers_norm()
    S, A, B = 3072, 512, 16
    for shape in args.shapes.split(","):
        fixture, layers = SHAPES[shape][0], args.layers
        tc = hf_config(fixture)
        cfg = config_from_dict({
            "drafter": {"num_layers": layers, "block_size": B, "num_anchors": A,
                        "micro_block_tokens": args.micro, "loss_chunk": args.loss_chunk,
                        "loss": args.loss},
            "optim": {"name": args.optim},
            "data": {"token_budget": 65536, "max_length": S},
            "layout": {"device": "cuda", "targets": [1], "drafters": [0]}})
        hf = json.loads((FIXTURES / fixture).read_text())
        plan = {r.device: r for r in plan_memory(cfg, hf).rows}["cuda:0"]
        margin = plan.components.get("cuda context", 0) + plan.components.get("allocator reserve", 0)
        print(f"  {shape}: preflight plan for the drafter GPU {gib(plan.total)}, its tensors "
              f"{gib(plan.total - margin)} (micro_block_tokens {args.micro})", flush=True)
        dc = build_drafter_config(tc, num_layers=layers, target_layer_ids=[1, 2, 3, 4, 5],
                                  block_size=B, mask_token_id=tc.vocab_size - 1)
        torch.manual_seed(0)
        drafter = DFlashDrafter(dc)
        embed = torch.nn.Embedding(tc.vocab_size, tc.hidden_size, dtype=torch.bfloat16, device="cuda")
        head = torch.nn.Linear(tc.hidden_size, tc.vocab_size, bias=False, dtype=torch.bfloat16, device="cuda")
        (rep,) = make_replicas(drafter, [torch.device("cuda:0")], cfg.drafter, cfg.optim, embed,
                               head)
        if args.batches:
            batch_costs(rep, args.batches, tc, A, args.stacks_after)
            del rep, drafter, embed, head
            torch.cuda.empty_cache()
            continue
        batch = batch_of(args.samples, S, tc.vocab_size)
        feats = torch.randn(args.samples, S, 5 * tc.hidden_size, device="cuda", dtype=torch.bfloat16)
        torch.cuda.reset_peak_memory_stats()
        times, opt_times = [], []
        for s in range(args.steps + 2):
            # A step stuck (compiling or otherwise) shows where it is instead of a silent limit.
            faulthandler.dump_traceback_later(args.stacks_after, repeat=True, file=sys.stdout)
            torch.cuda.synchronize()
            t = time.perf_counter()
            rep.accumulate(batch, feats, seed=0)
            torch.cuda.synchronize()
            t_opt = time.perf_counter()
            reduce_and_step([rep], s, 1000)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t)
            opt_times.append(time.perf_counter() - t_opt)  # reduce, clip, optimizer step
            faulthandler.cancel_dump_traceback_later()
            # Each step as it happens: the first ones compile FlexAttention (forward and backward).
            print(f"  {shape} step {s}: {times[-1]:.1f} s", flush=True)
        dt = sum(times[2:]) / len(times[2:])
        fl = step_flops(dc, args.samples, S, A, B, tc.vocab_size)
        n_params = sum(p.numel() for p in rep.params())
        print(f"| {shape}-shaped drafter, {args.loss} + {args.optim} (H {dc.hidden_size}, {layers} layers, vocab "
              f"{tc.vocab_size}, {n_params / 1e9:.2f}B trainable) | {args.samples / dt:.2f} "
              f"samples/s | MFU {fl / dt / H200_BF16_PEAK:.2f} | peak {gib(torch.cuda.max_memory_allocated())} "
              f"| plan {gib(plan.total)} | first step {times[0]:.1f} s (compile) "
              f"| step {dt:.3f} s, of it optimizer {sum(opt_times[2:]) / len(opt_times[2:]):.3f} s |")
        del rep, drafter, embed, head, feats
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
