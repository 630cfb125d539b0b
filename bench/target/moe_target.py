"""Mixture-of-experts targets: the engine's target features against a plain transformers forward,
and the peak memory against the memory plan.

For each shape (random weights of the release's size, built on the device: nothing is downloaded;
throughput and memory do not depend on the values) and each attention implementation, one batch of
--batch x --tokens tokens:

- plain: the decoder body (the language model from get_decoder(), every layer, no lm_head) under
  inference_mode, as one would run it with transformers;
- engine: TargetModel.features of the run's default layers (5 spread from 1 to N-3; it stops after
  the last one and never computes logits), as the engine's target worker runs it;
- plan: the memory plan's target tensors for that batch (planning/target_memory.target_tensors:
  weights, routed experts, residual stream, layer transient, mask, features) against each one's peak
  (torch.cuda.max_memory_allocated), and whether the peak stayed under --cap-gib (enforced as
  layout.gpu_memory_gib does, torch.cuda.set_per_process_memory_fraction, to rehearse a 96 GB
  card on a bigger one).

Then a check that the engine's features are the plain forward's hidden states (one short row).

    cd bench && python3 target/moe_target.py --shapes qwen3-30b-a3b,gpt-oss-20b --tokens 2048 \\
        --batch 16 --cap-gib 95
    cd bench && python3 target/moe_target.py --shapes gpt-oss-20b --attn eager,flex_attention
    cd bench && python3 target/moe_target.py --device cpu --shapes tiny-moe --tokens 32 --batch 2

--attn auto (the default) takes what preflight would choose for the target (sdpa, or eager for
gpt-oss, whose attention sinks SDPA cannot run).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: common.py
from common import FIXTURES, env_line, gib  # noqa: F401 - common puts the repository on sys.path

from dflash_core.config import config_from_dict
from dflash_core.models.target.model import TargetModel
from dflash_core.models.target.config import default_layer_ids

# name -> config.json of the shape (the releases' own keys; tiny ones for a CPU smoke run)
SHAPES = {
    "qwen3-30b-a3b": json.loads((FIXTURES / "qwen3_30b_a3b_config.json").read_text()),
    "gpt-oss-20b": json.loads((FIXTURES / "gpt_oss_20b_config.json").read_text()),
    "tiny-moe": {"model_type": "qwen3_moe", "vocab_size": 512, "hidden_size": 64,
                 "intermediate_size": 128, "moe_intermediate_size": 32, "num_hidden_layers": 8,
                 "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
                 "num_experts": 8, "num_experts_per_tok": 2, "tie_word_embeddings": False},
    "tiny-gpt-oss": {"model_type": "gpt_oss", "vocab_size": 512, "hidden_size": 64,
                     "intermediate_size": 32, "num_hidden_layers": 8, "num_attention_heads": 4,
                     "num_key_value_heads": 2, "head_dim": 16, "num_local_experts": 8,
                     "num_experts_per_tok": 2, "sliding_window": 16,
                     "max_position_embeddings": 131072, "tie_word_embeddings": False},
}


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="qwen3-30b-a3b,gpt-oss-20b",
                    help=f"comma list of {', '.join(SHAPES)}")
    ap.add_argument("--tokens", type=int, default=2048, help="tokens per sequence")
    ap.add_argument("--batch", type=int, default=16, help="sequences per batch")
    ap.add_argument("--cap-gib", type=float, default=0.0,
                    help="GiB this process may use per GPU (0: the card); 95 rehearses a "
                         "96 GB card")
    ap.add_argument("--attn", default="auto",
                    help="comma list of attention implementations; auto = preflight's choice")
    ap.add_argument("--iters", type=int, default=5, help="timed forwards per measurement")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    args = ap.parse_args(argv)
    args.shapes = [s.strip() for s in args.shapes.split(",") if s.strip()]
    unknown = [s for s in args.shapes if s not in SHAPES]
    if unknown or not args.shapes:
        ap.error(f"--shapes: unknown {unknown}; choose from {', '.join(SHAPES)}")
    args.attn = [a.strip() for a in args.attn.split(",") if a.strip()] or ["auto"]
    for name in ("tokens", "batch", "iters"):
        if getattr(args, name) < 1:
            ap.error(f"--{name} must be >= 1")
    if args.cap_gib < 0:
        ap.error("--cap-gib must be >= 0")
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("no CUDA device here: --device cpu for a smoke run on a tiny shape")
    return args


def run_config(shape: dict, args, attn: str):
    """The engine config this measurement stands for: one target, its default layers, a batch of
    --batch x --tokens, the attention implementation settled as preflight settles it."""
    from dflash_core.planning.attention_choice import choose_attention

    cfg = config_from_dict({
        "drafter": {"objective": "dflash"},  # the figures' objective (the target's plan differs)
        "layout": {"device": args.device, "targets": [0], "drafters": [0]},
        "target": {"attn_implementation": "sdpa" if attn == "auto" else attn},
        "data": {"token_budget": args.batch * args.tokens, "max_length": args.tokens,
                 "max_seqs_per_batch": args.batch}})
    said = []
    choose_attention(cfg, shape, said.append)
    return cfg, said


def build(shape: dict, device: str, dtype: torch.dtype, attn: str):
    """Random weights of ``shape`` built on ``device`` in ``dtype``; all-zero matrices (routers
    some classes zero-initialise) drawn again so that tokens spread over the experts."""
    from transformers import AutoConfig, AutoModelForCausalLM

    d = dict(shape)
    config = AutoConfig.for_model(d.pop("model_type"), **d)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attn)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2 and not p.any():
                p.normal_(0, 0.02)
    return model.requires_grad_(False).eval()


@dataclass
class Measured:
    tokens_per_s: float | None  # None: ran out of memory
    peak: int | None  # bytes allocated at the peak (CUDA), None on the CPU


def measure(fn, args, tokens: int) -> Measured:
    cuda = args.device == "cuda"
    try:
        fn()  # warm-up: kernels chosen, autotuned, compiled
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        t = time.perf_counter()
        for _ in range(args.iters):
            fn()
        if cuda:
            torch.cuda.synchronize()
        dt = (time.perf_counter() - t) / args.iters
        return Measured(tokens / dt, torch.cuda.max_memory_allocated() if cuda else None)
    except torch.OutOfMemoryError:
        return Measured(None, None)


def _gib(n: int | None) -> str:
    if n is None:
        return "-"
    v = n / 2**30
    return f"{v:.1f}" if v >= 1 else f"{v:.2g}"  # tiny shapes: not all 0.0


def _rate(m: Measured) -> str:
    return "OOM" if m.tokens_per_s is None else f"{m.tokens_per_s:,.0f}"


def bench_shape(name: str, args, cap: int | None) -> list[str]:
    """Table rows for one shape, one per attention implementation."""
    from dflash_core.planning.target_memory import target_tensors

    shape, rows = SHAPES[name], []
    cuda = args.device == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32  # as the engine runs targets
    for attn in args.attn:
        cfg, said = run_config(shape, args, attn)
        for line in said:
            print(f"  preflight: {line}")
        impl = cfg.target.attn_implementation
        t0 = time.perf_counter()
        model = build(shape, args.device, dtype, impl)
        weights = torch.cuda.memory_allocated() if cuda else None
        n_params = sum(p.numel() for p in model.parameters())
        plan = target_tensors(cfg, shape, on_cuda=cuda)
        print(f"{name} ({impl}): {n_params / 1e9:.2f}B parameters built in "
              f"{time.perf_counter() - t0:.0f} s; weights {_gib(weights)} GiB, planned "
              f"{_gib(plan['weights'] + plan.get('experts', 0))} GiB; plan for the batch: "
              + ", ".join(f"{k} {_gib(v)}" for k, v in plan.items()))
        target = TargetModel(model)
        layers = default_layer_ids(target.num_layers)
        gen = torch.Generator().manual_seed(1)
        ids = torch.randint(0, target.vocab_size, (args.batch, args.tokens),
                            generator=gen).to(args.device)
        tokens = ids.numel()

        def plain():
            with torch.inference_mode():
                target.decoder(input_ids=ids, use_cache=False)

        def engine():
            target.features(ids, None, layers)

        p, e = measure(plain, args, tokens), measure(engine, args, tokens)
        planned = sum(plan.values())
        under = "-" if cap is None or e.peak is None else ("yes" if e.peak <= cap else "no")
        ratio = (f"{e.tokens_per_s / p.tokens_per_s:.2f}"
                 if e.tokens_per_s and p.tokens_per_s else "-")
        rows.append(f"| {name} | {impl} | {args.batch}x{args.tokens} | {_rate(p)} | {_rate(e)} | "
                    f"{ratio} | {_gib(p.peak)} | {_gib(e.peak)} | {_gib(planned)} | "
                    f"{'-' if e.peak is None else f'{e.peak / planned:.2f}'} | {under} |")
        print(rows[-1])
        print(f"  features of layers {layers} = the plain forward's hidden states: max difference "
              f"{check_features(target, ids[:1, : min(args.tokens, 256)], layers):.2e}")
        del target, model
        if cuda:
            torch.cuda.empty_cache()
    return rows


def check_features(target: TargetModel, ids: torch.Tensor, layers: list[int]) -> float:
    with torch.inference_mode():
        hs = target.model(input_ids=ids, output_hidden_states=True).hidden_states
    feats = target.features(ids, None, layers)
    expected = torch.cat([hs[i + 1] for i in layers], dim=-1)
    return (feats.float() - expected.float()).abs().max().item()


HEADER = ("| shape | attention | batch | plain tok/s | engine tok/s | engine / plain | "
          "plain peak GiB | engine peak GiB | planned GiB | engine peak / plan | under cap |\n"
          "|---|---|---|---|---|---|---|---|---|---|---|")


def main(argv=None) -> list[str]:
    args = parse_args(argv)
    cap = None
    if args.device == "cuda":
        from dflash_core.planning.allocator import apply_card_limit, configure_allocator

        print(configure_allocator().describe())  # as the engine: expandable segments
        cap = apply_card_limit(torch.device("cuda:0"), args.cap_gib)
        print(f"cap: {gib(cap)} of {gib(torch.cuda.get_device_properties(0).total_memory)}")
    print(env_line())
    rows = []
    for name in args.shapes:
        rows += bench_shape(name, args, cap)
    print(HEADER)
    print("\n".join(rows))
    return rows


if __name__ == "__main__":
    main()
