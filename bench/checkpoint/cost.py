"""Checkpoint cost at the shipped drafter's size: training blocked per checkpoint, wall time to
durable, bytes, write rate, abort-to-exit time and resume time (issue 26).

    python bench/checkpoint/cost.py --size shipped --dir /tmp/ckpt-bench      # one H200
    python bench/checkpoint/cost.py --size small --dir /tmp/ckpt-bench        # CPU, minutes

The drafter is config.yaml's (8 layers, 5 target features) on the Qwen3.6-27B shape
(tests/fixtures/qwen3_6_27b_config.json), with AdamW moments made by one optimizer step, on one
GPU (CPU for --size small). Each writer count of --writers writes --checkpoints periodic
checkpoints through the engine's background writer (async_writer.py); then an abort's
checkpoint is timed from the request to durable with the writers gone (what a SIGTERM waits
for), and the last checkpoint is read back onto the device (resume). Only one checkpoint is
kept on disk at a time (a shipped one is ~40 GB). The resume reads from the page cache the
write just filled; a cold read is bounded by the disk instead.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: common.py
import common  # noqa: F401 - puts the repository on sys.path
from common import hf_config

from dflash_core.models.dflash.drafter import DFlashDrafter, build_drafter_config
from dflash_core.checkpoint import save_load as ckpt
from dflash_core.checkpoint.async_writer import CheckpointWriter
from dflash_core.checkpoint.staging import enough_shared_memory
from dflash_core.checkpoint.layout import CHECKPOINTS
from dflash_core.units import GiB


def build(size: str, device: torch.device):
    tc = hf_config("qwen3_6_27b_config.json")
    if size == "small":
        tc.hidden_size, tc.intermediate_size, tc.num_attention_heads = 512, 1536, 8
        tc.num_key_value_heads, tc.head_dim = 2, 64
    dc = build_drafter_config(tc, num_layers=8 if size == "shipped" else 2,
                              target_layer_ids=[1, 16, 31, 46, 61], block_size=16,
                              mask_token_id=tc.vocab_size - 1)
    torch.manual_seed(0)
    with torch.device(device):
        drafter = DFlashDrafter(dc).float()
    params = [p for p in drafter.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4, betas=(0.9, 0.95), fused=device.type == "cuda")
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    opt.step()
    for p in params:
        p.grad = None
    return drafter, opt


def job_of(drafter, opt, step, writers):
    sd = {k: v.detach() for k, v in drafter.state_dict().items()}
    return ckpt.make_job(step, drafter_state=sd, drafter_config=drafter.interchange_config(),
                         optimizer_state=opt.state_dict(), scheduler_state={"step": step},
                         trainer_state={"epoch": 0, "done": [], "rng": ckpt.capture_rng_state()},
                         served_dtype=torch.bfloat16, writers=writers)


def clear(run_dir: Path) -> None:
    shutil.rmtree(run_dir / CHECKPOINTS, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", choices=("shipped", "small"), default="shipped")
    ap.add_argument("--dir", default="/tmp/dflash-checkpoint-bench")
    ap.add_argument("--writers", default="1,4", help="writer counts to compare")
    ap.add_argument("--checkpoints", type=int, default=1, help="periodic ones per writer count")
    ap.add_argument("--mode", choices=("process", "thread"), default="process")
    ap.add_argument("--memory-fraction", type=float, default=0.68,  # ~96 GB of an H200
                    help="torch.cuda.set_per_process_memory_fraction")
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() and args.size == "shipped"
                          else "cpu")
    if device.type == "cuda":
        torch.cuda.set_per_process_memory_fraction(args.memory_fraction)
    run_dir = Path(args.dir)
    clear(run_dir)
    t = time.monotonic()
    drafter, opt = build(args.size, device)
    total = job_of(drafter, opt, 1, 1).bytes_total
    print(f"{args.size} drafter on {device}: {total / GiB:.2f} GiB per checkpoint "
          f"(built in {time.monotonic() - t:.1f} s); /dev/shm holds it: "
          f"{enough_shared_memory(total)}", flush=True)
    print("writers | staging alloc s | blocked s | wall s | GiB | GiB/s", flush=True)
    step = 0
    for writers in [int(w) for w in args.writers.split(",")]:
        w = CheckpointWriter(run_dir, writers, mode=args.mode)
        w.start()
        w.probe()  # the writers are up (a process imports torch first)
        t = time.monotonic()
        w.reserve(job_of(drafter, opt, 0, writers).tensors)
        alloc = time.monotonic() - t
        for _ in range(args.checkpoints):
            step += 1
            clear(run_dir)  # one checkpoint on disk at a time
            job = job_of(drafter, opt, step, writers)
            blocked = w.save(job, [job.tensors], keep=1)
            with torch.no_grad():  # training goes on meanwhile
                for p in drafter.parameters():
                    p.mul_(0.999)
            out = w.wait()
            assert out.path is not None, out.error
            print(f"{writers} | {alloc:.1f} | {blocked:.2f} | {out.seconds:.1f} | "
                  f"{out.bytes / GiB:.2f} | {out.bytes / GiB / out.seconds:.2f}", flush=True)
        if writers != int(args.writers.split(",")[-1]):
            w.close()
    # abort: from the request to durable with the writers gone (then the process may exit)
    step += 1
    clear(run_dir)
    t = time.monotonic()
    job = job_of(drafter, opt, step, w.writers)
    w.save(job, [job.tensors], keep=1, reason="abort")
    out = w.wait()
    durable = time.monotonic() - t
    w.close()
    print(f"abort ({w.writers} writers): durable {durable:.1f} s, writers gone "
          f"{time.monotonic() - t:.1f} s after the request", flush=True)
    # resume: read the folder and load it into a drafter and optimizer on the device
    t = time.monotonic()
    loaded = ckpt.load_checkpoint(out.path)
    read = time.monotonic() - t
    drafter.load_state_dict(loaded.drafter_state)
    opt.load_state_dict(loaded.optimizer_state)
    if device.type == "cuda":
        torch.cuda.synchronize()
    size = sum(p.stat().st_size for p in out.path.rglob("*") if p.is_file())  # subfolder too
    print(f"resume: read {size / GiB:.2f} GiB in {read:.1f} s ({size / GiB / read:.2f} GiB/s), "
          f"on the device {time.monotonic() - t:.1f} s", flush=True)
    clear(run_dir)


if __name__ == "__main__":
    main()
