"""The drafter GPU's memory plan term by term for each family at a bench shape (the plan is the
ledger: planning/drafter_memory.py), with the torch loss and with the fused one, and, measured on
the CPU, what a layer saves for backward beyond DFlash's (autograd's saved tensors under bf16
autocast at a tiny shape, per block token and layer, in 2-byte units of the width: the term the
plan's Family.layer_saved_h carries). Runs on the CPU in seconds; no GPU needed.

    python bench/training/memory_ledger.py [--shape 8B] [--objectives dflash,dspark,dflash2]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: common.py
sys.path.insert(0, str(Path(__file__).resolve().parent))  # drafter_step.py

import drafter_step as ds  # noqa: E402
from dflash_core.models.fused_loss import select  # noqa: E402
from dflash_core.planning.memory import plan_memory  # noqa: E402


def plan_rows(objective: str, shape: str, fused: bool) -> dict[str, int]:
    """{term: bytes} of the drafter GPU's row, as drafter_step.py's run plans it."""
    args = SimpleNamespace(objective=objective, layers=5, anchors=512, micro=16384,
                           loss="dflash", fused_loss="on" if fused else "off", markov_rank=256,
                           samples=8, seq_len=3072, optim="adamw", **dict(ds.DFLASH2_KEYS))
    args.block_size, args.loss_chunk = ds.OBJECTIVE_DEFAULTS[objective]
    before = select.triton_installed
    select.triton_installed = lambda: True  # plan as on a GPU machine (Triton ships there)
    try:
        plan = plan_memory(ds.run_config(args, args.samples * args.seq_len), ds.SHAPES[shape])
    finally:
        select.triton_installed = before
    return dict({r.device: r for r in plan.rows}["cuda:0"].components)


def saved_units(objective: str) -> float:
    """Bytes autograd saves per block token per layer at a tiny shape (bf16 autocast, CPU), in
    2-byte units of H: the slope over the number of blocks (weights and context cancel)."""
    from transformers import Qwen3Config

    from dflash_core.models.registry import new_drafter

    H, B, layers = 64, 6, 2
    tc = Qwen3Config(vocab_size=300, hidden_size=H, intermediate_size=128, num_hidden_layers=8,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    torch.manual_seed(0)
    m = new_drafter(objective, tc, num_layers=layers, target_layer_ids=[1, 3, 5], block_size=B,
                    mask_token_id=299).train()

    def saved(anchors: int) -> int:
        g = torch.Generator().manual_seed(0)
        ctx = torch.randn(1, 40, len(m.target_layer_ids) * H, generator=g)
        a = torch.arange(anchors)[None] * 2 + 1
        emb = torch.randn(1, anchors * B, H, generator=g)
        pos = (a[0, :, None] + torch.arange(B)).view(1, -1)
        seen = {}

        def pack(x):
            st = x.untyped_storage()
            seen[st.data_ptr()] = st.nbytes()
            return x

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x), \
                torch.autocast("cpu", dtype=torch.bfloat16):
            m(ctx, emb, pos, a)
        return sum(seen.values())

    return (saved(12) - saved(4)) / (8 * B * layers * H * 2)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="8B", choices=[s for s in ds.SHAPES if s != "tiny"])
    ap.add_argument("--objectives", default="dflash,dspark,dflash2")
    args = ap.parse_args(argv)
    objectives = [o.strip() for o in args.objectives.split(",") if o.strip()]
    plans = {(o, f): plan_rows(o, args.shape, f) for o in objectives for f in (False, True)}
    terms = list(dict.fromkeys(t for p in plans.values() for t in p))
    cols = [f"{o} {'fused' if f else 'torch'}" for o, f in plans]
    print(f"{args.shape}: the drafter GPU's plan in GiB (8 x 3072 tokens, 512 anchors, "
          "micro_block_tokens 16384, each family's block size and loss chunk)")
    print("| term | " + " | ".join(cols) + " |")
    print("|---|" + "---|" * len(cols))
    for t in terms + ["total"]:
        vals = [sum(p.values()) if t == "total" else p.get(t, 0) for p in plans.values()]
        print(f"| {t} | " + " | ".join(f"{v / 2**30:.2f}" for v in vals) + " |")
    base = saved_units("dflash")
    print("\nsaved for backward per block token and layer (CPU, bf16 autocast, tiny shape), "
          "2-byte units of H:")
    for o in objectives:
        u = saved_units(o)
        print(f"  {o}: {u:.2f} ({u - base:+.2f} beside DFlash's)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
