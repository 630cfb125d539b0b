"""Driving a target group's ranks by their messages (target_group/rank.py), without the engine."""

from __future__ import annotations

import queue
import time

import torch

from dflash_core.target_group.group import TargetGroup
from dflash_core.target_group.split import GroupSplit


def start_group(folder, mode: str, moe: bool, tmp, *, k: int = 2, layer_ids=(1, 2),
                last_hidden: bool = False, devices=None, dtype: str = "float32") -> TargetGroup:
    """A group of ``k`` ranks (on ``devices``, default the CPU) split as ``mode``; k = 1 is one
    rank holding the whole target (the CUDA hand-off and the process life on one GPU)."""
    split = GroupSplit(k, mode, expert_parallel=True)
    distributed = split.distributed(moe) if k > 1 else {}
    group = TargetGroup(0, devices or [torch.device("cpu")] * k, split, target_path=folder,
                        dtype=dtype, attn_implementation="sdpa", layer_ids=list(layer_ids),
                        last_hidden=last_hidden, trust_remote_code=False,
                        distributed=distributed, run_dir=tmp, publish=lambda e: None)
    group.start()
    return group


def reply(group: TargetGroup, rank: int, kinds: tuple, timeout: float = 120.0):
    """The next message of one of ``kinds`` from ``rank`` (others skipped); a rank's error or
    death fails the test with its words."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            msg = group.replies[rank].get(timeout=0.2)
        except queue.Empty:
            dead = group.dead_rank()
            if dead is not None:
                raise dead
            continue
        if msg[0] == "error":
            raise AssertionError(f"rank {rank}: {msg[2]}\n{msg[3]}")
        if msg[0] in kinds:
            return msg
    raise AssertionError(f"rank {rank}: no {kinds} within {timeout} s")


def wait_loaded(group: TargetGroup) -> None:
    for r in range(group.split.k):
        reply(group, r, ("loaded",))
