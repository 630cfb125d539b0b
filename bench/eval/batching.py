"""`dflash-tui eval`'s decoding at the 8B shape: prompts per second with prompts batched (one
target forward per round for the whole batch) against one at a time, and with the target's
cache one prompt at a time (--cache), for plain decoding and for a DFlash drafter.

    python bench/eval/batching.py --batches 1,4,8,16 --prompts 16 --prompt-tokens 256 \\
        --new-tokens 256

Random weights (nothing can be downloaded): the time does not depend on the values, but a random
drafter is accepted about never (tau ~1), so the drafter's rows show what a round costs, not a
speedup; the plain rows are the batching's effect on the target alone. The decoding code is the
command's own (eval.spec_decode.decode_rows with its target backends).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: common.py
from common import env_line, gib, hf_config, random_causal_lm
from dflash_core.eval.spec_decode import DecodeSettings, decode_rows
from dflash_core.eval.target_decoding import CachedRows, FullBatch, head_is_lm_head
from dflash_core.models.dflash.drafter import DFlashDrafter, build_drafter_config
from dflash_core.models.target.model import TargetModel
from dflash_core.models.target.config import default_layer_ids


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn) -> float:
    sync()
    t = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - t


def run(target, drafter, layers, prompts, batch, new, cache, exact):
    settings = DecodeSettings(new)

    def go():
        for k in range(0, len(prompts), batch):
            backend = (CachedRows(target, layers) if cache
                       else FullBatch(target, layers, exact))
            decode_rows(backend, drafter, prompts[k:k + batch], settings)

    return timed(go)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="qwen3_8b_config.json")
    ap.add_argument("--batches", default="1,4,8,16")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--drafter-layers", type=int, default=5)
    ap.add_argument("--block", type=int, default=16)
    ap.add_argument("--device", default="cuda", help="cuda (cpu: a dry run of a small shape)")
    args = ap.parse_args()
    print(env_line())
    tc = hf_config(args.shape)
    dev = torch.device(args.device)
    target = TargetModel(random_causal_lm(
        tc, device=dev, dtype=torch.bfloat16 if dev.type == "cuda" else torch.float32))
    on_gpu = dev.type == "cuda"
    memory = (lambda: gib(torch.cuda.max_memory_allocated())) if on_gpu else (lambda: "-")
    layers = default_layer_ids(target.num_layers)
    cfg = build_drafter_config(tc, num_layers=args.drafter_layers, target_layer_ids=layers,
                               block_size=args.block, mask_token_id=tc.vocab_size - 1)
    torch.manual_seed(1)
    drafter = DFlashDrafter(cfg).to(dev).eval()
    drafter.attn_impl = "chunked"
    drafter.attach_target_head(target.embed_tokens, target.lm_head)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, tc.vocab_size, (args.prompt_tokens,), generator=g).tolist()
               for _ in range(args.prompts)]
    exact = head_is_lm_head(target, prompts[0][:32], [0])
    print(f"{target.num_layers} layers, weights {memory()}; "
          f"{args.prompts} prompts of {args.prompt_tokens} tokens, {args.new_tokens} new; "
          f"drafter {args.drafter_layers} layers, block {args.block}; lm_head path {exact}",
          flush=True)
    run(target, drafter, layers, prompts[:2], 2, 8, False, exact)  # warm-up
    run(target, drafter, layers, prompts[:1], 1, 8, True, exact)
    print("| decoder | target | batch | seconds | prompts/s | new tokens/s | peak memory |")
    print("|---|---|---|---|---|---|---|")
    for name, d in (("plain", None), ("DFlash (random)", drafter)):
        rows = [(False, int(b)) for b in args.batches.split(",")] + [(True, 1)]
        for cache, batch in rows:
            if on_gpu:
                torch.cuda.reset_peak_memory_stats()
            s = run(target, d, layers, prompts, batch, args.new_tokens, cache, exact)
            n = len(prompts)
            print(f"| {name} | {'cache' if cache else 'full forwards'} | {batch} | {s:.1f} | "
                  f"{n / s:.2f} | {n * args.new_tokens / s:.0f} | "
                  f"{memory()} |", flush=True)


if __name__ == "__main__":
    main()
