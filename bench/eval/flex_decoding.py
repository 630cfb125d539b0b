"""Why compiled FlexAttention fails at decoding's shapes: one block of B queries after a context
of S tokens, in a process that first ran the training shapes (A anchors x B), as the run's
evaluation does. Tries each (B, S) with the kernel chosen by default and with the kernel options
given by --options, and prints the innermost error for each failure.

    python bench/eval/flex_decoding.py --heads 4 --kv-heads 2 --head-dim 32 --blocks 8,16
    python bench/eval/flex_decoding.py --heads 32 --kv-heads 8 --head-dim 128 --blocks 16

The first line is the demo drafter's attention, the second an 8B-shape drafter's.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: common.py
from common import cuda_time, env_line
from dflash_core.models import block_attention as ba


def innermost(exc: BaseException) -> str:
    while exc.__cause__ is not None or exc.__context__ is not None:
        exc = exc.__cause__ or exc.__context__
    text = f"{type(exc).__name__}: {exc}"
    return " ".join(text.split())[:400]


def attend(n, h, hkv, d, A, B, S, options, grad=False, dtype=torch.bfloat16):
    dev = "cuda"
    anchors = torch.full((n, A), S, device=dev) if A == 1 else torch.sort(
        torch.randperm(S - B, device=dev)[: n * A].view(n, A) + 1, dim=1).values
    q = torch.randn(n, h, A * B, d, device=dev, dtype=dtype, requires_grad=grad)
    kc, vc = (torch.randn(n, hkv, S, d, device=dev, dtype=dtype, requires_grad=grad)
              for _ in range(2))
    kb, vb = (torch.randn(n, hkv, A * B, d, device=dev, dtype=dtype, requires_grad=grad)
              for _ in range(2))
    mask = ba.make_block_mask(anchors, S, B)
    keys, vals = torch.cat([kc, kb], 2), torch.cat([vc, vb], 2)
    kw = {"kernel_options": options} if options else {}
    out = ba.compiled_flex()(q, keys, vals, block_mask=mask, scale=d ** -0.5,
                             enable_gqa=hkv != h, **kw)
    if grad:
        out.float().square().mean().backward()
    torch.cuda.synchronize()
    return out


def time_decoding(h, hkv, d, B, contexts, dtype):
    """ms per decoding call (one block after S tokens): compiled flex (warm, after its compile)
    against the uncompiled attention, and the first call's compile time."""
    for S in contexts:
        q = torch.randn(1, h, B, d, device="cuda", dtype=dtype)
        kc, vc = (torch.randn(1, hkv, S, d, device="cuda", dtype=dtype) for _ in range(2))
        kb, vb = (torch.randn(1, hkv, B, d, device="cuda", dtype=dtype) for _ in range(2))
        anchors = torch.full((1, 1), S, device="cuda")
        with torch.no_grad():
            t = time.perf_counter()
            ba.flex_block_attention(q, kc, vc, kb, vb, anchors, B, d ** -0.5)
            torch.cuda.synchronize()
            first = time.perf_counter() - t
            flex = cuda_time(lambda: ba.flex_block_attention(q, kc, vc, kb, vb, anchors, B,
                                                             d ** -0.5), iters=50)
            plain = cuda_time(lambda: ba.chunked_block_attention(q, kc, vc, kb, vb, anchors, B,
                                                                 d ** -0.5), iters=50)
        print(f"  time B={B} S={S}: compiled flex {flex * 1e3:.3f} ms (first call {first:.1f} s), "
              f"uncompiled {plain * 1e3:.3f} ms", flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=32)
    ap.add_argument("--blocks", default="8,16")
    ap.add_argument("--contexts", default="40,64,129,300,513,777")
    ap.add_argument("--dtype", default="bfloat16", help="bfloat16, or float32 as the demo trains")
    ap.add_argument("--inference-mode", action="store_true", help="decode under inference_mode")
    ap.add_argument("--options", default='{"FORCE_USE_FLEX_ATTENTION": true}',
                    help="JSON kernel_options tried after the default")
    ap.add_argument("--time", action="store_true",
                    help="also time one decoding call, compiled against uncompiled")
    args = ap.parse_args()
    print(env_line(), flush=True)
    h, hkv, d = args.heads, args.kv_heads, args.head_dim
    dtype = getattr(torch, args.dtype)
    quiet = torch.inference_mode if args.inference_mode else torch.no_grad
    for opts in (None, json.loads(args.options)):
        for B in (int(b) for b in args.blocks.split(",")):
            torch._dynamo.reset()
            ba._flex = None
            t = time.perf_counter()
            attend(2, h, hkv, d, 32, B, 256, opts, grad=True, dtype=dtype)  # the training shapes first
            print(f"options={opts} B={B}: training shape ok ({time.perf_counter() - t:.1f} s)",
                  flush=True)
            for S in (int(s) for s in args.contexts.split(",")):
                try:
                    with quiet():
                        attend(1, h, hkv, d, 1, B, S, opts, dtype=dtype)
                    print(f"  decode B={B} S={S}: ok", flush=True)
                except Exception as exc:  # noqa: BLE001 - the point is to see each failure
                    print(f"  decode B={B} S={S}: FAILED {innermost(exc)}", flush=True)

    if args.time:
        time_decoding(h, hkv, d, int(args.blocks.split(",")[-1]),
                      [int(s) for s in args.contexts.split(",")], dtype)


if __name__ == "__main__":
    main()
