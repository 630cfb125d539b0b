"""An FP8 block-wise target kept FP8 in a target group against its bf16 twin in the same group:
each rank's memory after loading, the group's feature tokens/s, and how far the FP8 group's
features are from the twin group's (||fp8 - bf16|| / ||bf16||, first batch of each stream).

Random weights (nothing downloaded): a Qwen3-MoE- or DeepSeek-V3-structured model of the widths
given (multiples of 2 x 128 so every tensor-parallel split keeps whole blocks), written as an FP8
block-wise checkpoint in the releases' layout (tests/core/target_group/fp8_targets.py) and as its
bf16 twin of the weights the FP8 ones stand for. Each group (k ranks on GPUs 0..k-1, or k CPU
ranks) loads on its own, runs one warm-up tick, then --batches timed ticks of --rows x --length
random tokens per stream (sharded: every rank its own stream; shared: one). Rank 0's line says
what multiplied the FP8 weights (transformers' kernels, or the engine's dequantizing matmul). One
JSON line on stdout.

    python bench/target/fp8_group.py --ranks 2 --mode sharded      # two GPUs
    python bench/target/fp8_group.py --ranks 2 --mode shared --model deepseek_v3
    OMP_NUM_THREADS=1 python bench/target/fp8_group.py --device cpu --hidden 256 --layers 2 \\
        --length 64 --batches 2     # the CPU dequantizes as it loads: memory alike
"""

from __future__ import annotations

import argparse
import json
import queue
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402


def model_config(name: str, hidden: int, layers: int, experts: int):
    import transformers as tf
    common = dict(vocab_size=4096, hidden_size=hidden, num_hidden_layers=layers,
                  num_attention_heads=hidden // 64, tie_word_embeddings=False,
                  max_position_embeddings=4096, moe_intermediate_size=max(256, hidden // 2),
                  num_experts_per_tok=2)
    if name == "qwen3_moe":
        return tf.Qwen3MoeConfig(**common, num_key_value_heads=max(2, hidden // 512),
                                 head_dim=128, intermediate_size=2 * hidden,
                                 num_experts=experts)
    return tf.DeepseekV3Config(
        **common, num_key_value_heads=hidden // 64, head_dim=64, q_lora_rank=hidden // 2,
        kv_lora_rank=64, qk_nope_head_dim=64, qk_rope_head_dim=64, v_head_dim=64,
        intermediate_size=2 * hidden, n_routed_experts=experts, n_shared_experts=1,
        first_k_dense_replace=1, n_group=2, topk_group=1)


def run_group(folder: Path, mode: str, devices: list, a, tmp: Path) -> dict:
    from dflash_core.target_group.group import TargetGroup
    from dflash_core.target_group.split import GroupSplit

    k = len(devices)
    split = GroupSplit(k, mode, True)
    g = TargetGroup(0, devices, split, target_path=folder, dtype="bfloat16",
                    attn_implementation="sdpa", layer_ids=[1, a.layers - 2], last_hidden=False,
                    trust_remote_code=False, distributed=split.distributed(True), run_dir=tmp,
                    publish=lambda e: None)
    t0 = time.perf_counter()
    g.start()

    def wait(rank, kind):
        while True:
            try:
                msg = g.replies[rank].get(timeout=1)
            except queue.Empty:
                if g.dead_rank():
                    raise g.dead_rank()
                continue
            if msg[0] == "error":
                raise RuntimeError(msg[2] + msg[3])
            if msg[0] == kind:
                return msg

    try:
        loaded = [wait(r, "loaded") for r in range(k)]
        start = time.perf_counter() - t0
        streams = list(range(k)) if mode == "sharded" else [0]
        gen = torch.Generator().manual_seed(0)
        feeds = [[torch.randint(0, 4096, (a.rows, a.length), generator=gen)
                  for _ in range(a.batches + 1)] for _ in streams]
        first, t = [], None
        for i in range(a.batches + 1):
            if i == 1:
                t = time.perf_counter()  # the first tick is the ranks' warm-up
            for r in range(k):
                ids = feeds[streams.index(r) if r in streams else 0][i]
                g.requests[r].put(("batch", i + 1, ids, torch.ones_like(ids)))
            for s, r in enumerate(streams):
                feats = wait(r, "features")[2]
                if i == 0:
                    first.append(feats.float().cpu())
                del feats
                g.requests[r].put(("ack", i + 1))
        rate = len(streams) * a.batches * a.rows * a.length / (time.perf_counter() - t)
    finally:
        g.shutdown()
    note = loaded[0][3]
    return {"rank_bytes": [msg[1] for msg in loaded], "tokens_per_s": round(rate),
            "start_s": round(start, 1), "line": note.line if note else None, "first": first}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--mode", choices=["sharded", "shared"], default="sharded")
    ap.add_argument("--model", choices=["qwen3_moe", "deepseek_v3"], default="qwen3_moe")
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--length", type=int, default=1024)
    ap.add_argument("--batches", type=int, default=8)
    a = ap.parse_args()
    from tests.core.target_group.fp8_targets import write_fp8

    devices = ([torch.device("cuda", i) for i in range(a.ranks)] if a.device == "cuda"
               else [torch.device("cpu")] * a.ranks)
    config = model_config(a.model, a.hidden, a.layers, a.experts)
    # preflight's checks of the split (a tensor-parallel one cutting an FP8 block fails the load)
    from dflash_core.models.target.shape import model_shape
    from dflash_core.target_group.fp8_split import check_fp8_split
    from dflash_core.target_group.split import GroupSplit, check_split
    hf = config.to_dict() | {"quantization_config": {"quant_method": "fp8",
                                                     "weight_block_size": [128, 128]}}
    split = GroupSplit(a.ranks, a.mode, True)
    check_split(split, model_shape(hf), quant="fp8")
    check_fp8_split(split, model_shape(hf), hf)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        print("writing the checkpoints", file=sys.stderr)
        write_fp8(root / "fp8", a.model, std=0.02, twin=root / "bf16", config=config)
        out = {}
        for kind in ("fp8", "bf16"):
            print(f"group of {a.ranks} ({a.mode}), {kind}", file=sys.stderr)
            out[kind] = run_group(root / kind, a.mode, devices, a, root)
    off = [((f - b).norm() / b.norm()).item()
           for f, b in zip(out["fp8"].pop("first"), out["bf16"].pop("first"))]
    print(json.dumps({"device": torch.cuda.get_device_name(0) if a.device == "cuda" else "cpu",
                      "torch": torch.__version__, **{k: v for k, v in vars(a).items()},
                      "fp8": out["fp8"], "bf16": out["bf16"],
                      "relative_difference": [round(x, 4) for x in off]}))


if __name__ == "__main__":
    main()
