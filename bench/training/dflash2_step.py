"""A drafter step's forward + backward, DFlash against DFlash2, on random inputs at the demo's
shape (width 128, vocabulary 258, 2 layers, B 8, 16 sequences x 32 anchors): what DFlash2's
convolutions and selector cost per step. The two alternate, ``--reps`` times each, on one
thread; the median is reported.

    OMP_NUM_THREADS=1 python bench/training/dflash2_step.py [--reps 20]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from transformers import Qwen3Config

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from dflash_core.config import config_from_dict  # noqa: E402
from dflash_core.models.objective import block_labels  # noqa: E402
from dflash_core.models.registry import new_drafter  # noqa: E402
from dflash_core.families.registry import settings as family_settings  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--vocab", type=int, default=258)
    args = ap.parse_args()
    torch.set_num_threads(1)
    H, V, L, S, n, A, B, k = args.hidden, args.vocab, 2, 128, 16, 32, 8, 3
    target = Qwen3Config(vocab_size=V, hidden_size=H, intermediate_size=2 * H,
                         num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=32)
    g = torch.Generator().manual_seed(0)
    feats = torch.randn(n, S, k * H, generator=g)
    ids = torch.randint(0, V - 1, (n, S), generator=g)
    anchors = torch.sort(torch.randint(0, S - B, (n, A), generator=g), -1).values
    labels = block_labels(ids, torch.ones_like(ids), anchors, B)
    emb = torch.nn.Embedding(V, H)
    head = torch.nn.Linear(H, V, bias=False)
    steps = {}
    for objective in ("dflash", "dflash2"):
        cfg = config_from_dict({"drafter": {"objective": objective, "block_size": B,
                                            "num_layers": L}})
        torch.manual_seed(0)
        d = new_drafter(objective, target, num_layers=L, target_layer_ids=[0, 1, 2],
                        block_size=B, mask_token_id=V - 1, settings=family_settings(cfg))
        d.attach_target_head(emb, head)
        loss = d.step_loss(cfg.drafter, family_settings(cfg))
        steps[objective] = (d, loss)
    times = {o: [] for o in steps}
    for _ in range(args.reps):
        for o, (d, loss) in steps.items():
            t0 = time.perf_counter()
            inputs, t = loss.targets(d, feats, labels, ids, anchors)
            bids, pos = d.block_inputs(ids, anchors)
            hidden = d(inputs, d.embed_tokens(bids).float(), pos, anchors)
            out = loss(d, hidden, pos, labels, t)
            (out.loss * out.weight_sum).backward()
            d.zero_grad(set_to_none=True)
            times[o].append(time.perf_counter() - t0)
    for o, ts in times.items():
        print(f"{o}: median {statistics.median(ts) * 1000:.1f} ms per forward + backward "
              f"(min {min(ts) * 1000:.1f}, {len(ts)} reps)")


if __name__ == "__main__":
    main()
