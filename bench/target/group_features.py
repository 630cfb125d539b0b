"""A target group of k ranks against one process on the same tiny mixture-of-experts target:
feature tokens/s and the group's start (spawn, process group, load) on this machine.

    OMP_NUM_THREADS=1 python bench/target/group_features.py --device cpu --ranks 2
    python bench/target/group_features.py --device cuda --ranks 1   # one GPU: the IPC hand-off

One process runs with as many threads as the group has ranks (one each), so both use the same
cores. Sharded mode: each rank its own batches, so the group's tokens/s is the sum of its ranks'.
"""

from __future__ import annotations

import argparse
import queue
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402


def build_target(folder: Path, hidden: int, layers: int) -> None:
    import transformers as tf
    cfg = tf.Qwen3MoeConfig(vocab_size=1024, hidden_size=hidden, intermediate_size=2 * hidden,
                            moe_intermediate_size=hidden // 2, num_experts=8,
                            num_experts_per_tok=2, num_hidden_layers=layers,
                            num_attention_heads=4, num_key_value_heads=2,
                            head_dim=hidden // 4, tie_word_embeddings=False)
    torch.manual_seed(0)
    tf.AutoModelForCausalLM.from_config(cfg).save_pretrained(folder)


def batches(n: int, rows: int, length: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 1024, (rows, length), generator=g) for _ in range(n)]


def one_process(folder, device, n, rows, length, layers, threads) -> float:
    from dflash_core.models.target.load import load_target
    torch.set_num_threads(threads)
    model = load_target(folder, device=device, dtype="float32")
    ids = batches(n + 1, rows, length, 0)
    model.features(ids[0], None, layers)  # warm-up
    t0 = time.perf_counter()
    for x in ids[1:]:
        model.features(x, None, layers)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return n * rows * length / (time.perf_counter() - t0)


def group(folder, device, k, n, rows, length, layers, tmp) -> tuple[float, float]:
    from dflash_core.target_group.group import TargetGroup
    from dflash_core.target_group.split import GroupSplit
    split = GroupSplit(k, "sharded", True)
    devices = ([torch.device("cuda", i) for i in range(k)] if device.type == "cuda"
               else [device] * k)
    g = TargetGroup(0, devices, split, target_path=folder, dtype="float32",
                    attn_implementation="sdpa", layer_ids=layers, last_hidden=False,
                    trust_remote_code=False, distributed=split.distributed(True) if k > 1 else {},
                    run_dir=tmp, publish=lambda e: None)
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

    for r in range(k):
        wait(r, "loaded")
    start = time.perf_counter() - t0
    feeds = [batches(n + 1, rows, length, 10 + r) for r in range(k)]
    seq = 0
    t = None
    for i in range(n + 1):
        if i == 1:
            t = time.perf_counter()  # the first tick is the ranks' warm-up
        seq += 1
        for r in range(k):
            g.requests[r].put(("batch", seq, feeds[r][i], torch.ones_like(feeds[r][i])))
        for r in range(k):
            feats = wait(r, "features")[2]
            own = feats.clone()
            del feats, own
            g.requests[r].put(("ack", seq))
    rate = k * n * rows * length / (time.perf_counter() - t)
    g.shutdown()
    return rate, start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--batches", type=int, default=8)
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--length", type=int, default=256)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    a = ap.parse_args()
    device = torch.device(a.device)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "target"
        build_target(folder, a.hidden, a.layers)
        layer_ids = [1, 2]
        one = one_process(folder, device, a.batches, a.rows, a.length, layer_ids, a.ranks)
        rate, start = group(folder, device, a.ranks, a.batches, a.rows, a.length, layer_ids,
                            Path(tmp))
    print(f"one process ({a.ranks} threads): {one:,.0f} feature tokens/s")
    print(f"group of {a.ranks} ranks (sharded): {rate:,.0f} feature tokens/s "
          f"({rate / one:.2f}x), started in {start:.1f} s")


if __name__ == "__main__":
    main()
