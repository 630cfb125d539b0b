"""A target's features for one long sample: tokens/s and the peak against the memory plan.

The engine's target worker (TargetModel.features of the run's default layers; it stops after the
last one) on one sequence of each --lengths tokens (a batch of one: no padding mask), with random
weights of the release's size built on the GPU. For each length: feature tokens/s, the peak
allocated (torch.cuda.max_memory_allocated) and the plan's target tensors for that batch
(planning/target_memory.target_tensors: weights, residual stream, layer transient, features), and
whether the peak stayed under --cap-gib (set as layout.gpu_memory_gib sets it, to rehearse a 96 GB
card on a bigger one).

    cd bench && python3 target/long_features.py --shape qwen3.6-27b --lengths 32768,131072 \\
        --cap-gib 95
    cd bench && python3 target/long_features.py --device cpu --shape tiny-hybrid --lengths 64,256
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: common.py
from common import FIXTURES, env_line, hf_config  # noqa: E402 - common puts the repo on sys.path
from moe_target import measure  # noqa: E402 - warm-up, timed forwards, the peak, or OOM

from dflash_core.config import config_from_dict  # noqa: E402
from dflash_core.models.target.config import default_layer_ids  # noqa: E402
from dflash_core.models.target.model import TargetModel  # noqa: E402

SHAPES = {
    "qwen3.6-27b": json.loads((FIXTURES / "qwen3_6_27b_config.json").read_text()),
    "qwen3-8b": json.loads((FIXTURES / "qwen3_8b_config.json").read_text()),
    # a CPU smoke run: the 27B's layer pattern (3 Gated DeltaNet, 1 full attention) at toy width
    "tiny-hybrid": {"model_type": "qwen3_5_text", "vocab_size": 512, "hidden_size": 64,
                    "intermediate_size": 128, "num_hidden_layers": 8, "num_attention_heads": 4,
                    "num_key_value_heads": 2, "head_dim": 16, "linear_num_key_heads": 2,
                    "linear_num_value_heads": 4, "linear_key_head_dim": 16,
                    "linear_value_head_dim": 16, "full_attention_interval": 4,
                    "max_position_embeddings": 4096, "tie_word_embeddings": False},
}


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="qwen3.6-27b", choices=sorted(SHAPES))
    ap.add_argument("--lengths", default="32768,131072", help="comma list: tokens of the sample")
    ap.add_argument("--cap-gib", type=float, default=0.0,
                    help="GiB this process may use on the GPU (0: the card); 95 rehearses a "
                         "96 GB card")
    ap.add_argument("--iters", type=int, default=2, help="timed forwards per length")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    args = ap.parse_args(argv)
    try:
        args.lengths = [int(x) for x in args.lengths.split(",") if x.strip()]
    except ValueError:
        ap.error(f"--lengths: integers separated by commas, not {args.lengths!r}")
    if not args.lengths or min(args.lengths) < 1:
        ap.error("--lengths: one or more positive token counts")
    if args.iters < 1 or args.cap_gib < 0:
        ap.error("--iters must be >= 1 and --cap-gib >= 0")
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("no CUDA device here: --device cpu --shape tiny-hybrid for a smoke run")
    return args


def plan_for(shape: dict, length: int, device: str) -> dict[str, int]:
    """The plan's target tensors for a batch of one sample of ``length`` tokens."""
    from dflash_core.planning.target_memory import target_tensors

    cfg = config_from_dict({  # DFlash's target: its selected layers only (DSpark runs them all)
        "drafter": {"objective": "dflash"},
        "layout": {"device": device, "targets": [0], "drafters": [0]},
        "data": {"token_budget": length, "max_length": length, "max_seqs_per_batch": 1}})
    return target_tensors(cfg, shape, on_cuda=device == "cuda")


def _gib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**30:.2f}"


def main(argv=None) -> None:
    args = parse_args(argv)
    cuda = args.device == "cuda"
    shape = SHAPES[args.shape]
    cap = None
    if cuda and args.cap_gib:
        total = torch.cuda.get_device_properties(0).total_memory
        cap = int(args.cap_gib * 2**30)
        torch.cuda.set_per_process_memory_fraction(min(1.0, cap / total), 0)
    print(env_line())
    cfg = hf_config(shape)
    t0 = time.perf_counter()
    torch.manual_seed(0)
    from transformers import AutoModelForCausalLM
    with torch.device(args.device):
        model = AutoModelForCausalLM.from_config(
            cfg, dtype=torch.bfloat16 if cuda else torch.float32, attn_implementation="sdpa")
    model.requires_grad_(False).eval()
    target = TargetModel(model)
    layers = default_layer_ids(target.num_layers)
    weights = torch.cuda.memory_allocated() if cuda else None
    print(f"{args.shape}: {sum(p.numel() for p in model.parameters()) / 1e9:.2f}B parameters "
          f"built in {time.perf_counter() - t0:.0f} s, weights {_gib(weights)} GiB, feature "
          f"layers {layers} (the forward stops after layer {max(layers)})")
    print("| sample tokens | feature tokens/s | s per sample | peak GiB | plan GiB | plan / peak "
          "| under the cap | plan's terms (GiB) |")
    print("|---|---|---|---|---|---|---|---|")
    gen = torch.Generator().manual_seed(1)
    for L in args.lengths:
        plan = plan_for(shape, L, args.device)
        ids = torch.randint(0, target.vocab_size, (1, L), generator=gen).to(args.device)
        m = measure(lambda: target.features(ids, None, layers), args, L)
        peak, dt = m.peak, None if m.tokens_per_s is None else L / m.tokens_per_s
        rate = "OOM" if dt is None else f"{m.tokens_per_s:,.0f}"
        planned = sum(plan.values())
        under = "-" if cap is None or peak is None else ("yes" if peak <= cap else "no")
        ratio = "-" if peak is None else f"{planned / peak:.2f}"
        terms = ", ".join(f"{k} {v / 2**30:.2f}" for k, v in plan.items())
        print(f"| {L:,} | {rate} | {'-' if dt is None else f'{dt:.2f}'} | {_gib(peak)} | "
              f"{_gib(planned)} | {ratio} | {under} | {terms} |", flush=True)
        del ids
        if cuda:
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
