"""What a round of exact-tau decoding costs the target: a full forward over the sequence
(eval.cache: false) against a forward of the block with the target's cache (eval.cache: true),
at the real shapes and several context lengths.

    python bench/eval/cost.py --shapes 8B,27B --lengths 512,1024,2048,4096

A round verifies a block of --block tokens after a context of L tokens and keeps --accept of
them: full forwards run L + block tokens; the cache runs the block, then is cut back (an
attention-only target's cache is cropped; a hybrid one's is restored from a copy and fed the
accepted tokens again). The drafter's part of a round is the same either way and is left out.
Random weights (nothing can be downloaded): the time does not depend on the values.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: common.py
from common import cuda_time, env_line, gib, hf_config, random_causal_lm
from dflash_core.eval.evaluate import target_fn_for
from dflash_core.models.target.model import TargetModel
from dflash_core.models.target.config import default_layer_ids
from dflash_core.eval.target_decoding import CachedDecoding, FullDecoding, attention_only

SHAPES = {"8B": "qwen3_8b_config.json", "27B": "qwen3_6_27b_config.json"}


def ms_per_round(dec, context: list[int], block: int, accept: int, rounds: int) -> float:
    dec.feed(context, last=1)

    def one():  # like a decoding round: the context grows by what it kept
        kept = len(dec.tokens) + accept + 1
        dec.feed(list(range(1, block + 1)))
        dec.rewind(kept)

    return cuda_time(one, iters=rounds, warmup=1) * 1e3


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="8B,27B")
    ap.add_argument("--lengths", default="512,1024,2048,4096", help="context tokens")
    ap.add_argument("--block", type=int, default=16, help="drafter.block_size")
    ap.add_argument("--accept", type=int, default=3, help="drafted tokens kept per round")
    ap.add_argument("--rounds", type=int, default=8)
    args = ap.parse_args()
    print(env_line())
    for shape in args.shapes.split(","):
        tc = hf_config(SHAPES[shape])
        tm = TargetModel(random_causal_lm(tc))
        layers = default_layer_ids(tm.num_layers)
        kind = "attention only" if attention_only(tm.text_config) else "hybrid"
        print(f"{shape}: {tm.num_layers} layers ({kind}), weights "
              f"{gib(torch.cuda.memory_allocated())}; block {args.block}, {args.accept} kept",
              flush=True)
        g = torch.Generator().manual_seed(0)
        for n in (int(x) for x in args.lengths.split(",")):
            ctx = torch.randint(0, tc.vocab_size, (n,), generator=g).tolist()
            full = ms_per_round(FullDecoding(target_fn_for(tm, layers), "cuda"), ctx,
                                args.block, args.accept, args.rounds)
            cached = ms_per_round(CachedDecoding(tm, layers), ctx, args.block, args.accept,
                                  args.rounds)
            print(f"| {shape} | {n} | full {full:.1f} ms | cached {cached:.1f} ms | "
                  f"{full / cached:.2f}x |", flush=True)
        del tm
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
